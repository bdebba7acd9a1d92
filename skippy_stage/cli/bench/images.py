"""The head's image path on 3 stages against the unsplit model with llama-cpp-python's libmtmd:
what encoding an image costs at the head, and the time to first token of a prompt with one; and a
Qwen2-VL image's encode (a grid of rows its size decides) on the random-weight Qwen2-VL fixture, which
needs the source checkout (``mrope_encode``)."""

from __future__ import annotations

import io
import time
from functools import partial
from pathlib import Path

import numpy as np

from skippy_stage.cli.bench.pipeline import _awake, _Pipeline, after_freeze, stage_threads
from skippy_stage.cli.bench.readings import _scrape
from skippy_stage.cli.bench.workload import QUICK, THREE
from skippy_stage.cli.client import generate

IMAGE_PROMPT = "<|im_start|>user\n<__media__>\nDescribe this picture.<|im_end|>\n<|im_start|>assistant\n"
IMAGE_SIZE = (320, 240)  # resized by the preprocessor to the projector's image_size
IMAGE_ROUNDS = 1 if QUICK else 5
_ENCODE = "skippy_image_encode_seconds"
# The Qwen2-VL fixture's image: 200x120 pixels, a 13x8 grid (104 rows on 13 positions).
MROPE_IMAGE_SIZE = (200, 120)
MROPE_PROMPT = "tok_1 <__media__> tok_2"


def ppm_image(width: int, height: int, seed: int) -> bytes:
    """A binary PPM of seeded random pixels: a format the head decodes, with no encoder needed here."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=width * height * 3, dtype=np.uint8)
    return b"P6 %d %d 255\n" % (width, height) + pixels.tobytes()


def _images(model: Path, workdir: Path, cache_dir: str) -> dict[str, object]:
    """A 3-stage pipeline whose head alone has a projector (a random-weight one,
    ``write_projector``), and the unsplit model with the same projector in this process
    (``MultimodalReference``), in interleaved rounds (medians; each round a new image, the same
    on both sides, so no cache answers it), the pipeline frozen while the reference runs.

    Per image, the encode (libmtmd's tower and projection): at the head from its
    ``skippy_image_encode_seconds`` histogram, in this process around ``mtmd_encode_chunk``. Time to
    first token: the pipeline's as its client sees it (one token asked for); the one process's is the
    prefill of the prompt and its image from an empty context, which decides the first token (the
    argmax of its last row, not timed), less the reference's extra encode that times the encode alone
    (llama-cpp-python's handler encodes once, in ``mtmd_helper_eval_chunk_single``)."""
    from skippy_stage.model.chain import chain_configs
    from skippy_stage.model.multimodal_reference import MultimodalReference
    from skippy_stage.model.projector_fixture import write_projector

    started = time.perf_counter()
    threads = stage_threads(len(THREE))  # each stage's, and the one process's: the same budget
    (workdir / "images").mkdir()
    projector = write_projector(model, workdir / "images" / "mmproj.gguf", seed=0).path
    cfg = chain_configs(model, [(0, THREE[-1][1])], None, ctx_size=2048, n_threads=threads,
                        flash_attn_type="disabled")[0]
    runs: dict[str, list[float]] = {"head_encode_ms": [], "single_encode_ms": [], "pipeline_ttft_ms": [],
                                    "single_ttft_ms": [], "single_prefill_ms": []}
    ref = pipeline = None
    try:
        ref = MultimodalReference(cfg, projector, logits_all=False)
        pipeline = _Pipeline(model, THREE, workdir / "images", cache_dir,
                             per_stage=[{"projector_path": str(projector)}])

        def ask(image: bytes) -> dict[str, float]:
            return generate(pipeline.endpoint, IMAGE_PROMPT, max_tokens=1, temperature=0.0, seed=None, chat=False,
                            out=io.StringIO(), media=[image])

        prompt_tokens = ask(ppm_image(*IMAGE_SIZE, seed=1_000))["prompt_tokens"]  # warm
        with _awake([pipeline], None):
            ref.prefill(IMAGE_PROMPT, [ppm_image(*IMAGE_SIZE, seed=1_000)])  # warm
        for round_ in range(IMAGE_ROUNDS):
            image = ppm_image(*IMAGE_SIZE, seed=round_)
            with _awake([pipeline], None):
                began = time.perf_counter()
                ref.prefill(IMAGE_PROMPT, [image])
                prefill_s = time.perf_counter() - began
            runs["single_prefill_ms"].append(prefill_s * 1e3)
            runs["single_ttft_ms"].append((prefill_s - sum(ref.encode_s)) * 1e3)
            runs["single_encode_ms"].append(sum(ref.encode_s) / len(ref.encode_s) * 1e3)
            with _awake([pipeline], pipeline):
                before = _scrape(pipeline.metrics_ports[0])
                figures = after_freeze(partial(ask, image))
                after = _scrape(pipeline.metrics_ports[0])
            encoded = after.get(f"{_ENCODE}_count", 0.0) - before.get(f"{_ENCODE}_count", 0.0)
            seconds = after.get(f"{_ENCODE}_sum", 0.0) - before.get(f"{_ENCODE}_sum", 0.0)
            if encoded < 1:
                raise RuntimeError(f"the head counted no image encode ({_ENCODE}) for a prompt with an image")
            runs["head_encode_ms"].append(seconds / encoded * 1e3)
            runs["pipeline_ttft_ms"].append(figures["ttft_s"] * 1e3)
    finally:
        if ref is not None:
            ref.close()
        if pipeline is not None:
            pipeline.stop()
    m = {key: float(np.median(values)) for key, values in runs.items()}
    return {"mrope_encode_ms_per_image": mrope_encode(workdir / "images", threads),
            "stages": [list(r) for r in THREE], "image": f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} PPM, random pixels",
            "projector": "random weights (write_projector, seed 0)", "prompt_tokens": prompt_tokens,
            "rounds": IMAGE_ROUNDS, "seconds": time.perf_counter() - started,
            "encode_ms_per_image": {"head": m["head_encode_ms"], "single_process": m["single_encode_ms"],
                                    "ratio": m["single_encode_ms"] / m["head_encode_ms"]},
            "ttft_ms_one_image": {"pipeline": m["pipeline_ttft_ms"], "single_process": m["single_ttft_ms"],
                                  "single_process_prefill_with_extra_encode": m["single_prefill_ms"],
                                  "ratio": m["single_ttft_ms"] / m["pipeline_ttft_ms"]}}


def mrope_encode(workdir: Path, threads: int) -> dict[str, object]:
    """One Qwen2-VL image's encode: the head's projector (loaded by a head runtime of the random-weight
    ``qwen2vl-dense`` fixture, as ``serve`` loads it; the time its ``MediaSpan`` records, which the
    head's metric observes) against ``MultimodalReference`` in this process, in interleaved rounds, each
    a new image (medians). ``{"skipped": why}`` outside a source checkout."""
    import dataclasses

    from skippy_stage.cli.bench.mtp import ARCHS
    from skippy_stage.model import synthetic
    from skippy_stage.model.chain import chain_configs
    from skippy_stage.model.multimodal_reference import MultimodalReference
    from skippy_stage.model.projector_fixture import write_projector
    from skippy_stage.model.runtime import StageRuntime

    if not ARCHS.is_file():
        return {"skipped": f"the random-weight Qwen2-VL fixture needs the source checkout's "
                           f"{ARCHS.relative_to(ARCHS.parents[2])}"}
    model = synthetic.write_model(synthetic.load_specs(ARCHS)["qwen2vl-dense"], workdir / "qwen2vl.gguf", seed=42)
    projector = write_projector(model, workdir / "qwen2vl-mmproj.gguf", seed=1, kind="qwen2vl").path
    settings = {"ctx_size": 2048, "n_threads": threads, "flash_attn_type": "disabled"}
    (whole,) = chain_configs(model, [(0, 6)], None, **settings)
    head_cfg = dataclasses.replace(chain_configs(model, [(0, 2), (2, 6)], str(workdir), **settings)[0],
                                   projector_path=str(projector))
    ref = head = None
    head_ms: list[float] = []
    single_ms: list[float] = []
    try:
        ref = MultimodalReference(whole, projector, logits_all=False)
        head = StageRuntime(head_cfg)
        grid = None
        for round_ in range(-1, IMAGE_ROUNDS):  # the first round warms both
            image = ppm_image(*MROPE_IMAGE_SIZE, seed=2_000 + round_)
            (span,) = head.projector.prompt(MROPE_PROMPT, [image]).media
            ref.prefill(MROPE_PROMPT, [image])
            if round_ >= 0:
                head_ms.append(span.encode_s * 1e3)
                single_ms.append(ref.encode_s[0] * 1e3)
            grid = span.grid
    finally:
        if head is not None:
            head.close()
        if ref is not None:
            ref.close()
    h, s = float(np.median(head_ms)), float(np.median(single_ms))
    return {"image": f"{MROPE_IMAGE_SIZE[0]}x{MROPE_IMAGE_SIZE[1]} PPM, random pixels",
            "grid": f"{grid[0]}x{grid[1]}", "rows": grid[0] * grid[1],
            "model": "qwen2vl-dense fixture, random weights; write_projector(kind='qwen2vl', seed 1)",
            "head": h, "single_process": s, "ratio": s / h}
