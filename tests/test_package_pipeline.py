"""A split served from a layer package, checked from outside: ``skippy-stage up --package URL
--stages 3`` starts real ``serve`` processes, each with a cache of its own (as on three hosts),
each fetching its parts from an HTTP server; the texts equal the unsplit model's, and the server's
log shows that each stage read the manifest, the metadata part and its own parts, and nothing else."""

from __future__ import annotations

import io

from support.packages import PackageServer
from support.pipeline import reference_texts
from support.up import running_up

from skippy_stage.cli.client import generate
from skippy_stage.model.package import MANIFEST_NAME, write_package

MAX_TOKENS = 32
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_up_from_a_package_over_http_completes_the_unsplit_models_text_from_each_stages_own_parts(smollm2, tmp_path):
    written = write_package(smollm2, tmp_path / "pkg", progress=False)
    caches = {f"stage-{i}": tmp_path / f"cache-{i}" for i in range(3)}
    settings = [arg for stage, cache in caches.items() for arg in ("--set", f"{stage}.cache_dir={cache}")]
    texts = []
    with PackageServer(tmp_path / "pkg") as server:
        with running_up("--package", server.url, "--stages", "3", "--lanes", "2", "--ctx-size", "4096", *settings,
                        cache=tmp_path / "unused-cache", log=tmp_path / "up.log") as (endpoint, _):
            for prompt in PROMPTS:
                out = io.StringIO()
                generate(endpoint, prompt, max_tokens=MAX_TOKENS, temperature=0.0, seed=None, chat=False, out=out)
                texts.append(out.getvalue())
        fetched = {stage: sorted(server.paths(agent=f"({stage})")) for stage in caches}
        by_up = [r.path for r in server.requests if "(stage-" not in r.agent]

    assert texts == reference_texts(smollm2, PROMPTS, MAX_TOKENS)
    assert by_up == [MANIFEST_NAME]  # up reads the manifest to learn the block count and pin its sha256
    for i, (stage, paths) in enumerate(fetched.items()):
        layers = [f"layers-{n:03d}-{n + 1:03d}.gguf" for n in range(10 * i, 10 * i + 10)]
        embedding = [] if stage == "stage-1" else ["embedding.gguf"]  # the head, and the tied head of the final
        assert paths == sorted([MANIFEST_NAME, "metadata.gguf", *layers, *embedding]), stage
    assert "manifest sha256 " + written.manifest_sha256 in (tmp_path / "up.log").read_text()
    assert not (tmp_path / "unused-cache").exists()
