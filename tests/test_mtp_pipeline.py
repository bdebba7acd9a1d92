"""Native MTP through real processes: the final stage drafts, the head verifies.

A random-weight DeepSeek-2 with one next-n block (``mtp_fixture``) split 0:3 / 3:7 over two
``serve`` processes; the final stage has ``native_mtp_enabled``, and a generation asks for the
``mtp`` drafter. Each sample comes back with the MTP layers' guess of the next token, which the
head sends with it in its next step as a draft to verify (``[last, draft]``, every row sampled,
a rejected draft rewound on every stage). Held to the one-process reference run with the same
batches (``support.mtp_reference.mtp_decode``: the prompt, then each ``[last, draft]``), and so
to plain greedy decoding: the committed tokens are the same, and as many drafts are verified as
the reference verifies; and the schedule it ran replays exactly on the unsplit model
(``skippy-stage replay``). Random weights almost never draft right; acceptance is printed, not
tuned for.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import grpc
import llama_cpp
import pytest
from support.mtp_reference import MtpModel, greedy_decode, mtp_decode

from skippy_stage.cli.local import free_ports
from skippy_stage.model import synthetic
from skippy_stage.model.mtp_fixture import with_nextn
from skippy_stage.model.replay import replay
from skippy_stage.model.schedule import SAMPLE_VERIFY, Schedule
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

SPECS = synthetic.load_specs(Path(__file__).resolve().parent / "fixtures" / "archs.jsonl.gz")
PROMPT = "Hello world, the cat sat on the mat."
N_TOKENS = 24
# The reference's context (support.mtp_reference): the same cells per lane and batch sizes.
CONTEXT = dict(ctx_size=256, lane_count=1, n_batch=64, n_ubatch=64, n_threads=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthetic.write_model(with_nextn(SPECS["deepseek2-moe"]), tmp_path_factory.mktemp("mtp") / "ds-mtp.gguf",
                                 seed=42)


@pytest.fixture(scope="module")
def prompt_tokens(model) -> list[int]:
    """The prompt as the head tokenizes it (special tokens added and parsed)."""
    llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def pipeline(start_pipeline, model):
    port = free_ports("127.0.0.1", 1)[0]
    return start_pipeline(model, [(0, 3), (3, 7)], native_mtp_enabled=[False, True], metrics_port=[port, None],
                          **CONTEXT), port


def generate(pipeline, drafter: str) -> list[int]:
    request = pb.GenerateRequest(prompt=PROMPT, max_tokens=N_TOKENS, sampling=pb.SamplingParams(temperature=0),
                                 speculative=pb.Speculative(drafter=drafter, k=1))
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        return [t for m in pb_grpc.StageServiceStub(channel).Generate(request, timeout=120) for t in m.token_ids]


def speculation(port: int) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    drafted = float(re.search(r"^skippy_spec_drafted_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))
    accepted = float(re.search(r"^skippy_spec_accepted_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))
    return drafted, accepted


def test_mtp_drafts_from_the_final_stage_commit_exactly_the_greedy_tokens(pipeline, model, prompt_tokens):
    """The head verifies every draft the final stage returns: the tokens are plain greedy decoding's and
    the reference's with the same batches, and it verified as many drafts as the reference drafted."""
    stages, port = pipeline
    with MtpModel(model) as reference:
        greedy = greedy_decode(reference, prompt_tokens, N_TOKENS)
        drafted = mtp_decode(reference, prompt_tokens, N_TOKENS)
    before = speculation(port)
    tokens = generate(stages, "mtp")
    after = speculation(port)
    assert tokens == drafted.tokens == greedy.tokens
    verified, kept = after[0] - before[0], after[1] - before[1]
    assert (verified, kept) == (drafted.n_drafted, drafted.n_accepted)
    print(f"MTP drafts kept {int(kept)}/{int(verified)} (random weights)")
    assert generate(stages, "none") == greedy.tokens


def test_an_mtp_generation_replays_exactly_on_the_unsplit_model(pipeline, model):
    """The replay checker holds the batches the pipeline ran (prompt, then each [last, draft] window
    with its rewinds) to the unsplit model: every sampled row bit-identical, the same tokens."""
    stages, _ = pipeline
    request = pb.GenerateRequest(prompt=PROMPT, max_tokens=N_TOKENS, sampling=pb.SamplingParams(temperature=0),
                                 speculative=pb.Speculative(drafter="mtp", k=1), record_schedule=True)
    with grpc.insecure_channel(stages.head_endpoint) as channel:
        messages = list(pb_grpc.StageServiceStub(channel).Generate(request, timeout=120))
    schedule = Schedule.from_json(messages[-1].schedule_json)
    assert any(step.sample == SAMPLE_VERIFY for step in schedule.steps), "the generation verified drafts"
    report = replay(schedule, model)
    assert report.exact, report.mismatch
    assert report.tokens == len(schedule.completion) == N_TOKENS


def test_the_mtp_drafter_on_a_chain_whose_final_stage_does_not_draft_is_refused_by_name(start_pipeline, model):
    """Without native_mtp_enabled on the final stage no draft comes back: the generation fails naming
    the setting, rather than running on without the speculation it asked for."""
    plain = start_pipeline(model, [(0, 3), (3, 7)], **CONTEXT)
    with pytest.raises(grpc.RpcError) as refused:
        generate(plain, "mtp")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "native_mtp_enabled: true" in refused.value.details()
