"""The head's image path on 3 stages against the unsplit model with llama-cpp-python's libmtmd:
what encoding an image costs at the head, and the time to first token of a prompt with one."""

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
    return {"stages": [list(r) for r in THREE], "image": f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} PPM, random pixels",
            "projector": "random weights (write_projector, seed 0)", "prompt_tokens": prompt_tokens,
            "rounds": IMAGE_ROUNDS, "seconds": time.perf_counter() - started,
            "encode_ms_per_image": {"head": m["head_encode_ms"], "single_process": m["single_encode_ms"],
                                    "ratio": m["single_encode_ms"] / m["head_encode_ms"]},
            "ttft_ms_one_image": {"pipeline": m["pipeline_ttft_ms"], "single_process": m["single_ttft_ms"],
                                  "single_process_prefill_with_extra_encode": m["single_prefill_ms"],
                                  "ratio": m["single_ttft_ms"] / m["pipeline_ttft_ms"]}}
