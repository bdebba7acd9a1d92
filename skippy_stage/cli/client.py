"""A gRPC client of the head's ``Generate``: what ``generate``, ``demo`` and ``bench`` call."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from skippy_stage.config import AUTO_DRAFT_K, DRAFTERS
from skippy_stage.errors import SkippyError
from skippy_stage.security import Credentials

# Longest a client waits for one whole generation.
GENERATE_TIMEOUT_S = 600


def client_credentials(args: argparse.Namespace) -> Credentials:
    """TLS material and token for a client, from --tls-ca/--tls-cert/--tls-key/--token-file."""
    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    token = Path(args.token_file).read_text().strip() if args.token_file else None
    cert = read(args.tls_cert)
    ca = read(args.tls_ca)
    return Credentials(cert=cert, key=read(args.tls_key), ca=ca, token=token)


def speculative_flags(args: argparse.Namespace) -> dict[str, object]:
    """--speculative/--draft-k/--draft-ngram/--draft-model as SpeculativeConfig fields (only those
    given). A number k is fixed drafting, whatever adaptive setting it lands on."""
    given = {"drafter": args.speculative, "k": args.draft_k, "ngram": args.draft_ngram,
             "model_path": getattr(args, "draft_model", None)}
    flags = {k: v for k, v in given.items() if v is not None}
    if isinstance(flags.get("k"), int):
        flags["adaptive"] = False
    return flags


def draft_k(text: str) -> int | str:
    """--draft-k: a number of tokens, or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of tokens nor 'auto'") from None


def add_speculative_flags(p: argparse.ArgumentParser, *, model: bool) -> None:
    p.add_argument("--speculative", choices=DRAFTERS, default=None,
                   help="draft tokens to verify several per trip: ngram (prompt lookup), model (a draft GGUF) or "
                        "mtp (the model's own multi-token-prediction layers, native_mtp_enabled on the final stage)")
    p.add_argument("--draft-k", type=draft_k, default=None, metavar="K|auto",
                   help="tokens drafted per step: K drafts exactly as llama-cpp-python's "
                        "LlamaPromptLookupDecoding(num_pred_tokens=K) (default 8); auto: adaptive, up to "
                        f"{AUTO_DRAFT_K}, which changes batch shapes (greedy text may then differ from the reference's)")
    p.add_argument("--draft-ngram", type=int, default=None,
                   help="ngram drafter: longest n-gram looked up (default 2, LlamaPromptLookupDecoding's)")
    if model:
        p.add_argument("--draft-model", default=None, help="model drafter: a GGUF sharing the target's vocabulary")


def generate(endpoint: str, prompt: str, *, max_tokens: int, temperature: float, seed: int | None,
              chat: bool, out: TextIO = sys.stdout, credentials: Credentials | None = None,
              speculative: dict[str, object] | None = None, stream_interval_ms: int | None = None,
              record_schedule: str | None = None, media: list[bytes] | None = None) -> dict[str, float]:
    """Stream one generation's text to ``out``; its timing figures. ``record_schedule``: a file to
    write the batch schedule the pipeline ran to (``skippy-stage replay``). ``media``: images for the
    prompt's media markers; a prompt without any gets one per image before its text (as llama.cpp's
    mtmd-cli puts them)."""
    import grpc

    from skippy_stage.v1 import stage_pb2 as pb
    from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    request = pb.GenerateRequest(max_tokens=max_tokens, sampling=sampling)
    if speculative:
        fields = dict(speculative)
        if fields.get("k") == "auto":  # the wire's k is a number: "auto" is adaptive up to AUTO_DRAFT_K
            fields.update(k=AUTO_DRAFT_K, adaptive=True)
        request.speculative.CopyFrom(pb.Speculative(**fields))
    if stream_interval_ms is not None:
        request.stream_interval_ms = stream_interval_ms
    request.record_schedule = record_schedule is not None
    if media:
        from skippy_stage.model.projector import MEDIA_PART  # (it loads llama.cpp: only when images go)

        request.media.extend(media)
        if MEDIA_PART not in prompt:
            prompt = MEDIA_PART * len(media) + "\n" + prompt
    if chat:
        request.messages.append(pb.ChatMessage(role="user", content=prompt))
    else:
        request.prompt = prompt
    started = time.perf_counter()
    first = None
    final = None
    credentials = credentials or Credentials()
    with credentials.channel(endpoint, []) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        try:
            for msg in stub.Generate(request, timeout=GENERATE_TIMEOUT_S, metadata=credentials.call_metadata()):
                if msg.text:
                    if first is None:
                        first = time.perf_counter() - started
                    out.write(msg.text)
                    out.flush()
                if msg.done:
                    final = msg
        except grpc.RpcError as err:
            raise SkippyError(f"Generate failed: {err.code().name}: {err.details()}") from None
    elapsed = time.perf_counter() - started
    if record_schedule is not None and final is not None:
        Path(record_schedule).write_text(final.schedule_json)
    n = final.completion_tokens if final else 0
    return {"ttft_s": first or elapsed, "seconds": elapsed, "completion_tokens": n,
            "prompt_tokens": final.prompt_tokens if final else 0,
            "tokens_per_s": (n - 1) / max(elapsed - (first or 0), 1e-9) if n > 1 else 0.0}
