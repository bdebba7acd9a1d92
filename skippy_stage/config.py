"""Stage configuration: one frozen object that travels from the CLI to every component.

Field names follow the Rust seed (skippy-server's StageConfig) so configs stay portable.
Validation happens once, here, and every message names the stage, the field and the
value: the reader is usually an operator looking at a crash-looping pod.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from skippy_stage.errors import ConfigError

# Bytes per element of each KV cache type (llama.cpp's ggml block sizes: quantised types
# store 32 elements per block). The one table of cache types; its keys are the names.
CACHE_TYPE_BYTES: dict[str, Fraction] = {
    "f32": Fraction(4),
    "f16": Fraction(2),
    "bf16": Fraction(2),
    "q8_0": Fraction(34, 32),
    "q4_0": Fraction(18, 32),
    "q4_1": Fraction(20, 32),
    "iq4_nl": Fraction(18, 32),
    "q5_0": Fraction(22, 32),
    "q5_1": Fraction(24, 32),
}
CACHE_TYPES = tuple(CACHE_TYPE_BYTES)
FLASH_ATTN_TYPES = ("auto", "disabled", "enabled")
LOAD_MODES = ("runtime-slice", "artifact-slice", "layer-package")
# The seed's split modes; "auto" leaves llama.cpp's default (layer).
SPLIT_MODES = ("auto", "none", "layer", "row", "tensor")
WIRE_DTYPES = ("f32", "f16", "bf16", "int8")
# max_message_bytes' ceiling: gRPC's message size options are signed 32-bit ints (and a frame's
# header carries a 32-bit length).
MAX_MESSAGE_BYTES = 2**31 - 1
HOP_TRANSPORTS = ("tcp", "stream")
# checkpoint_quantization: "preserve" (serve the slice as the GGUF holds it) or the llama.cpp file types a
# stage can requantize its slice to (llama_ftype LLAMA_FTYPE_MOSTLY_<name>, named as llama-quantize names them).
CHECKPOINT_QUANTIZATIONS = (
    "preserve", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1",
    "Q4_0", "IQ4_XS", "IQ4_NL", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "Q2_K",
    "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "TQ2_0", "TQ1_0",
)
# The largest CPU latency the kernel's QoS takes (its "no request" value).
WAKE_LATENCY_MAX_US = 2_000_000_000
# llama.cpp's LLAMA_MAX_SEQ: a context cannot hold more sequences (lanes) than this.
MAX_LANES = 256
# Longest session id any stage accepts (it names a lane in logs, status and metrics).
MAX_SESSION_ID_LEN = 256
# The longest a head holds a generation's tokens back to send them together (stream_interval_ms).
MAX_STREAM_INTERVAL_MS = 1000

_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://")
_SHA256 = re.compile(r"[0-9A-Fa-f]{64}")
# Where a layer package may be fetched from (besides a plain directory).
PACKAGE_SCHEMES = ("file", "http", "https")
_ENDPOINT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>\d{1,5})$")


# OpenMP's spin count for stages that share this machine's cores. llama-cpp-python's CPU backend
# runs on OpenMP, whose idle workers spin for ~300k iterations after each graph (and at every
# barrier inside one): a stage that just finished would spin on the cores the next stage needs.
# Measured with a 3-stage SmolLM2 pipeline on 2 cores (single-stream decode vs the unsplit
# model, same run): spin count 0: 0.31x, 200: 0.52x, 1000: 0.68x, 2000: 0.69x, 5000: 0.67x,
# 20000: 0.64x, libgomp's default: 0.32x (an AMD EPYC; an Intel Xeon gave its best at 1000-3000
# too). Only here: a stage alone on its host wants libgomp's default, which keeps its worker
# awake between frames; with 2000 it sleeps, and waking it cost a 10-layer slice 10.5 ms instead
# of 1.9 after 10 ms between frames on a 2-vCPU VM. Set in the stages' environment (libgomp reads
# it when it loads); an operator's value wins.
SHARED_HOST_SPINCOUNT = "2000"
# And their OpenMP threads bound one to a core (thread i on the i-th place): no worker migrates
# onto the core where a stage's frame thread, OpenMP's thread 0, runs its Python. Measured with
# SmolLM2 on a 2-vCPU Xeon before the rotation below (bench's single-stream decode phase, five
# interleaved pairs of runs): 3 stages 0.78-0.83x the unsplit model bound against 0.71-0.80x
# unbound, better in every pair; 2 stages 0.85x either way (mean of five); the unsplit model alone
# decodes as fast bound or not. Same rules as above: co-located stages only, an operator's
# OMP_PROC_BIND / OMP_PLACES / GOMP_CPU_AFFINITY wins.
SHARED_HOST_PROC_BIND = "true"
# And each stage's binding starts at its own core: stage i's thread 0 on the (i mod n)-th of the n
# cores it may use, its workers on the next ones (stages given fewer threads than cores start that
# many cores apart instead, each on cores of its own while there are enough). libgomp binds the
# thread that loads it (a stage's main thread) to the first place, and every thread started after
# it inherits that core: with the same first place everywhere, every stage's Python (frame path,
# gRPC, the head's scheduler) ran on one core, and a stage woken by a frame waited there for the
# sender's last Python while the other core idled. Rotated, neighbours run their Python on
# different cores. Measured with SmolLM2 on a 2-vCPU Xeon (single-stream decode, interleaved A/B
# rounds, rotated vs not): 2 stages 1.036x (7 rounds, 6 faster), 3 stages 1.012x (three stages on
# two cores: one leg of the ring must share a core). The launcher marks the environment; the
# stage, which knows its index and its cores, writes OMP_PLACES before llama.cpp loads libgomp. An
# operator's placement wins.
SHARED_HOST_PLACES_ENV = "SKIPPY_OMP_PLACES_BY_STAGE"
_OPERATOR_PLACEMENT = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")
# And OMP_WAIT_POLICY=active beside a spin count we set. With GOMP_SPINCOUNT given, the policy
# changes one number in libgomp (env.c): the *throttled* spin, what every barrier spins once the
# process runs more OpenMP threads than it has cores, from 100 to min(1000, GOMP_SPINCOUNT). A
# process gets there as soon as a second thread of it decodes — each thread that calls
# llama_decode leads an OpenMP team of its own, kept for the thread's life: the head's scheduler
# workers with max_inflight > 1, frames over gRPC streams or unary calls. At 100 spins nearly
# every barrier of the graph sleeps and is woken. Measured with SmolLM2 on a 2-vCPU Xeon (single
# stream, A/B rounds): 2 stages with max_inflight 2 decoded at 0.921 ± 0.020 of max_inflight 1
# (10 rounds, none faster); with the policy 0.990 ± 0.019 (2 stages) / 1.002 ± 0.015 (3). With
# one decoding thread per process it changes nothing: 0.994 ± 0.008 / 0.999 ± 0.022 (16 rounds).
# (Moving the head's next decode onto its return listener's thread made its llama_decode 1.1 ms
# slower this way, 5.8 against 4.6 ms.)
SHARED_HOST_WAIT_POLICY = "active"
# A head alone on its host that runs several steps at once (max_inflight > 1) decodes on as many
# threads, each leading n_threads - 1 workers: more OpenMP threads than cores, so the throttled
# spin above, at 100. It gets libgomp's own spin for an unset policy (3 ms) with the policy that
# lifts the throttled one to 1000 (on a hybrid x86 CPU libgomp would have chosen a spin of 1 with
# neither set). An operator's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
STANDALONE_SPINCOUNT = "300000"
# Where llama.cpp was built without OpenMP, stages decode on ggml's own thread pool
# (``model.threadpool``), whose idle threads poll after a graph for as long as this level says
# before they sleep: not at all for co-located stages (a stage that finished must not spin on
# the cores the next one decodes on, as with OpenMP's spin count above); llama.cpp's default
# elsewhere. An operator's value wins.
SHARED_HOST_GGML_POLL = "0"
GGML_POLL_ENV = "SKIPPY_GGML_POLL"


def shared_host_openmp(environ: dict[str, str]) -> dict[str, str]:
    """What co-located stages add to ``environ`` (none of it where the operator chose)."""
    added = {} if "GOMP_SPINCOUNT" in environ else {"GOMP_SPINCOUNT": SHARED_HOST_SPINCOUNT}
    if added and "OMP_WAIT_POLICY" not in environ:
        added["OMP_WAIT_POLICY"] = SHARED_HOST_WAIT_POLICY
    if not set(_OPERATOR_PLACEMENT) & set(environ):
        added["OMP_PROC_BIND"] = SHARED_HOST_PROC_BIND
        added[SHARED_HOST_PLACES_ENV] = "1"
    if GGML_POLL_ENV not in environ:
        added[GGML_POLL_ENV] = SHARED_HOST_GGML_POLL
    return added


def several_teams_openmp(max_inflight: int, head: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """What a stage that is not co-located adds to ``environ`` before libgomp loads: for a head
    that runs several steps at once (``max_inflight`` > 1, so as many decoding threads), the
    policy that keeps libgomp's throttled spin at 1000, with libgomp's own spin count for an unset
    policy (see ``STANDALONE_SPINCOUNT``). Nothing elsewhere, or where the operator chose."""
    if max_inflight < 2 or not head or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(environ):
        return {}
    return {"OMP_WAIT_POLICY": SHARED_HOST_WAIT_POLICY, "GOMP_SPINCOUNT": STANDALONE_SPINCOUNT}


def stage_openmp_places(stage_index: int, n_threads: int, environ: Mapping[str, str],
                        cpus: Iterable[int]) -> dict[str, str]:
    """OMP_PLACES for a co-located stage (``environ`` marked by :func:`shared_host_openmp`): one
    place per core it may use (``cpus``), the list rotated so that stages that each take every
    core start one core apart, and stages that take ``n_threads`` of them start ``n_threads``
    apart (side by side, each on cores of its own while there are enough). Nothing where the
    launcher did not mark it, where the operator placed the threads, or where the rotation is
    none (libgomp's default places are the same list unrotated)."""
    if environ.get(SHARED_HOST_PLACES_ENV) != "1" or {"OMP_PLACES", "GOMP_CPU_AFFINITY"} & set(environ):
        return {}
    cores = sorted(cpus)
    if not cores:
        return {}
    step = n_threads if n_threads < len(cores) else 1
    k = stage_index * step % len(cores)
    if k == 0:
        return {}
    return {"OMP_PLACES": ",".join(f"{{{c}}}" for c in cores[k:] + cores[:k])}


@dataclass(frozen=True)
class Endpoint:
    """A host:port pair; IPv6 hosts are written in brackets."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def strip_tcp_scheme(text: object) -> object:
    """``tcp://host:port`` -> ``host:port`` (the seed writes endpoints with the scheme)."""
    if isinstance(text, str) and text[:6].lower() == "tcp://":
        return text[6:]
    return text


def parse_endpoint(text: object, *, stage_id: str, field_name: str, allow_port_zero: bool = False) -> Endpoint:
    """Parse ``host:port`` or ``tcp://host:port``; port 0 is allowed only for a bind address (ask the OS)."""
    if not isinstance(text, str):
        raise ConfigError(f"stage {stage_id}: {field_name} must be a host:port string, got {text!r}")
    scheme = _SCHEME.match(text)
    if scheme is not None and scheme["scheme"].lower() != "tcp":
        raise ConfigError(
            f"stage {stage_id}: {field_name}={text!r} uses scheme {scheme['scheme']!r}; "
            f"only tcp://host:port (or host:port) is supported"
        )
    text = str(strip_tcp_scheme(text))
    match = _ENDPOINT.match(text)
    if match is None:
        raise ConfigError(f"stage {stage_id}: {field_name} must be host:port, got {text!r}")
    port = int(match["port"])
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ConfigError(f"stage {stage_id}: {field_name} has port {port} out of range in {text!r}")
    return Endpoint(host=match["v6"] or match["host"], port=port)


@dataclass(frozen=True)
class PeerConfig:
    """A neighbouring stage: who it is and where it listens."""

    stage_id: str
    stage_index: int
    endpoint: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", strip_tcp_scheme(self.endpoint))

    @property
    def address(self) -> Endpoint:
        return parse_endpoint(self.endpoint, stage_id=self.stage_id, field_name="endpoint")


DRAFTERS = ("none", "ngram", "model", "mtp")
MAX_DRAFT_K = 16
# Most speculative windows of one session in flight at the head (verify_window_depth).
MAX_VERIFY_WINDOW_DEPTH = 8
# Most chunks of one prompt in flight at the head (prefill_chunks_in_flight).
MAX_PREFILL_CHUNKS_IN_FLIGHT = 16
AUTO_DRAFT_K = 8  # k="auto": adaptive drafting, at most this many tokens per step
MAX_NGRAM = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the head speculates (its ``speculative`` config), and one generation's own settings
    over it (``override``; a request may not name a draft model file).

    ``k`` a number is fixed drafting: every step drafts what the drafter finds, up to k, as
    llama-cpp-python's ``Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))`` does, so
    the batches are the reference's and greedy text equals its text. ``k="auto"`` asks for adaptive
    drafting by name; built, it is ``k=AUTO_DRAFT_K, adaptive=True``."""

    # "none", "ngram" (prompt lookup), "model" (a draft GGUF at the head) or "mtp" (the final stage's own
    # multi-token-prediction layers, native_mtp_enabled there: one draft a step, returned with each sample)
    drafter: str = "none"
    # Most tokens drafted per step: a number (fixed: the reference's drafting, exactly), or "auto"
    # (adaptive, up to AUTO_DRAFT_K).
    k: int = 8
    ngram: int = 2  # ngram: the longest n-gram looked up (LlamaPromptLookupDecoding's max_ngram_size)
    # The long form of k="auto", with k as its ceiling: draft 4, two more after a step whose drafts
    # were all kept, fewer (down to none) while drafts are rejected; ngram: look up where the context
    # agrees. It changes the batches' shapes, and with them the kernels: greedy text may then differ
    # from the reference's (and from a run without speculation).
    adaptive: bool = False
    model_path: str | None = None  # model: the draft GGUF, sharing the target's vocabulary

    def __post_init__(self) -> None:
        if isinstance(self.k, str) and self.k == "auto":
            object.__setattr__(self, "k", AUTO_DRAFT_K)
            object.__setattr__(self, "adaptive", True)

    @property
    def enabled(self) -> bool:
        return self.drafter != "none"

    def problem(self) -> str | None:
        """What is wrong with these settings (field and value), or None."""
        if self.drafter not in DRAFTERS:
            return f"drafter={self.drafter!r} must be one of {', '.join(DRAFTERS)}"
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_DRAFT_K:
            return f"k={self.k!r} must be an integer in [1, {MAX_DRAFT_K}] or 'auto'"
        if isinstance(self.ngram, bool) or not isinstance(self.ngram, int) or not 1 <= self.ngram <= MAX_NGRAM:
            return f"ngram={self.ngram!r} must be an integer in [1, {MAX_NGRAM}]"
        if not isinstance(self.adaptive, bool):
            return f"adaptive={self.adaptive!r} must be true or false"
        if self.model_path is not None and not isinstance(self.model_path, str):
            return f"model_path={self.model_path!r} must be a path"
        return None

    def override(self, *, drafter: str | None = None, k: int | str | None = None, ngram: int | None = None,
                 adaptive: bool | None = None) -> SpeculativeConfig:
        """These settings with a request's over them. A number k of its own is fixed drafting,
        whatever the head's (unless the request also says ``adaptive``)."""
        if k is not None and k != "auto" and adaptive is None:
            adaptive = False
        changes = {name: value for name, value in (("drafter", drafter), ("k", k), ("ngram", ngram),
                                                   ("adaptive", adaptive)) if value is not None}
        return dataclasses.replace(self, **changes) if changes else self


@dataclass(frozen=True)
class StageConfig:
    """Everything one stage process needs. Build it with :func:`load_config` or :meth:`from_dict`."""

    model_path: str
    """The GGUF of the whole model (sliced to this stage's range at start, cached), or with
    ``load_mode: artifact-slice`` a stage file ``skippy-stage slice`` wrote. With ``package_ref`` it is
    not read and may be left unset: the stage points it at the model's header fetched from the package."""
    stage_id: str
    """This stage's name: in logs, metrics, status, every error message, and its neighbours' configs."""
    stage_index: int
    """Its place in the chain, 0 for the head; a neighbour's must be one less (upstream) or one more (downstream)."""
    layer_start: int
    """The first layer this stage runs; 0 makes it the head (tokenizer, sampling, the generation loop)."""
    layer_end: int
    """One past the last layer it runs; the model's block count makes it the final stage's range."""
    run_id: str = "local"
    """Names the deployment in logs and status (the seed's run id)."""
    topology_id: str = "local"
    """Names the chain's layout in status (the seed's topology id)."""
    model_id: str = ""
    """Names the model in status (free text)."""
    ctx_size: int | None = None
    """KV cells of this stage's context, over all lanes. Unset: the model's training context for each
    lane (``kv_unified: false``) or for the one shared pool (``true``), capped so the KV cache takes at
    most half the memory available (the runtime logs which, and why)."""
    lane_count: int = 4
    """Sessions this stage holds at once (llama.cpp sequences); at most 256 and at most ``n_ubatch``."""
    n_batch: int = 512
    """Most tokens one llama_decode takes; longer prompts are fed in chunks of this many."""
    n_ubatch: int = 512
    """Most tokens one micro-batch computes (at most ``n_batch``)."""
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    """llama.cpp threads for decoding (default: every core of the host; ``up`` sets it per stage)."""
    n_threads_batch: int | None = None
    """llama.cpp threads for prompt batches; unset: ``n_threads``."""
    n_gpu_layers: int = 0
    """Layers offloaded to the device (-1: all of this stage's)."""
    mmap: bool | None = None
    """Map the file rather than read it; unset: llama.cpp decides (it maps where every device supports it)."""
    mlock: bool = False
    """Lock the model's pages in memory (llama.cpp load mode MLOCK / MMAP_MLOCK)."""
    direct_io: bool = False
    """Read the file with direct I/O (llama.cpp load mode DIRECT_IO); excludes ``mmap`` and ``mlock``."""
    repack: bool = False
    """Repack weights into llama.cpp's extra buffer types (``use_extra_bufts``), as stock llama-cpp-python
    does: other kernels (and with them other bits, exactly stock ``Llama``'s) and faster prefill for
    Q4_0/Q4_K weights on AVX2/AVX-512 CPUs. Off as in the seed; refused on a CPU with AMX_INT8, where the
    AMX repack crashes llama.cpp (#20824)."""
    check_tensors: bool = False
    """Have llama.cpp validate tensor data while loading (slower start)."""
    no_host_buffer: bool = False
    """Keep weights out of host-pinned buffers (llama.cpp ``no_host``)."""
    op_offload: bool | None = None
    """Offload host tensor operations to the device; unset: llama.cpp's default."""
    cache_type_k: str = "f16"
    """Type of the K cache: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1."""
    cache_type_v: str = "f16"
    """Type of the V cache (same types; a quantized V needs flash attention)."""
    flash_attn_type: str = "disabled"
    """auto, disabled or enabled. Disabled as llama-cpp-python's ``Llama()`` runs, which keeps the
    split == unsplit contract exact ("auto" picks other kernels on CPU)."""
    kv_offload: bool = True
    """Keep the KV cache on the device where layers are offloaded."""
    kv_unified: bool = False
    """Off: each lane has KV cells of its own, ``ctx_size / lane_count``, so a session's text does not
    depend on what other sessions do and a finished chat keeps its prefix resident for its next turn.
    On: one pool shared by every lane (llama-server's parallel slots): one session may use the whole
    context, but other sessions' cells change the attention's summation blocks (greedy text then
    depends on load) and no prefix stays resident."""
    swa_full: bool = False
    """Give sliding-window layers a full-size KV cache (llama.cpp ``swa_full``)."""
    cache_idle_slots: int | None = None
    """Reset lanes kept warm, and resident prefixes kept for a later turn; unset: one per lane; 0: none."""
    split_mode: str = "auto"
    """How a stage spreads over several devices: auto (llama.cpp's default, layer), none, layer, row, tensor."""
    main_gpu: int = 0
    """The device for ``split_mode: none`` and small tensors."""
    selected_device: str | None = None
    """A backend device by name (``skippy-stage info`` lists them), or the seed's object
    ``{"backend_device": NAME, ...}``; unset: llama.cpp's own choice."""
    load_mode: str = "runtime-slice"
    """runtime-slice: slice ``model_path`` to this range at start (cached); artifact-slice:
    ``model_path`` is already the stage file, or with ``package_ref`` the stage file is assembled from the
    package's parts; layer-package: refused (offline-only in the seed)."""
    package_ref: str | None = None
    """A layer package (``skippy-stage package`` writes one) to load this stage from: its directory, or a
    ``file://`` or ``http(s)://`` URL of it. The stage fetches the manifest, then only the parts its layer
    range needs (resumably, each checked against its sha256 in the manifest) into ``cache_dir``, where the
    stages of one host share them, and assembles its stage file from them. Needs ``manifest_sha256`` and
    ``load_mode: artifact-slice``. Unset: the stage loads ``model_path``."""
    manifest_sha256: str | None = None
    """With ``package_ref``: the sha256 of the package's ``manifest.json`` (``skippy-stage package`` prints
    it). A manifest that does not match is refused, and the manifest names every part's sha256, so this
    one value pins every byte the stage loads."""
    checkpoint_quantization: str = "preserve"
    """preserve: serve the layers as the GGUF holds them. A llama.cpp type (``Q8_0``, ``Q6_K``, ``Q5_K_M``,
    ``Q4_K_M``, ``Q4_0``, ``IQ4_XS``, ``IQ2_XXS``, ...): at load the stage quantizes its own slice with
    ``llama_model_quantize`` into ``cache_dir`` (reused afterwards), giving every tensor the type the whole
    model's quantization to that type gives it, so a pipeline quantized stage by stage computes what the
    whole model quantized once computes. Stages of one pipeline may use different types. Needs the whole
    GGUF in ``model_path`` (``load_mode: runtime-slice``) or a ``package_ref``; a stage file alone is refused."""
    checkpoint_imatrix: str | None = None
    """A llama.cpp importance matrix (the GGUF ``llama-imatrix`` writes) for ``checkpoint_quantization``;
    the IQ1/IQ2 types (and ``IQ3_XXS``, ``Q2_K_S``) need one. Needs ``checkpoint_imatrix_sha256``."""
    checkpoint_imatrix_sha256: str | None = None
    """The sha256 of ``checkpoint_imatrix``, checked before it is used."""
    projector_path: str | None = None
    """Head only: a multimodal projector (an mmproj GGUF) for this model. Prompts may then carry images
    (the OpenAI API's ``image_url`` parts, ``Generate``'s ``media``): libmtmd encodes them here and their
    rows enter the head's layers where the prompt puts them; the stages below see hidden states as for
    any prompt (and a Qwen2-VL image's grid, for its M-RoPE positions). Only projector types proven
    against the unsplit model are accepted (``mlp``, ``qwen2vl_merger``); ``skippy-stage make-projector``
    writes a random-weight one to smoke-test a deployment."""
    projector_use_gpu: bool | None = None
    """Run the projector on a GPU. This build is CPU only: unset or false."""
    media_marker: str | None = None
    """The text that stands for an image in a prompt (one per image, in order); unset: libmtmd's
    ``<__media__>``. The OpenAI API puts it where a message has an ``image_url`` part."""
    image_min_tokens: int | None = None
    """Fewest rows an image may become: libmtmd scales a Qwen2-VL image into
    ``image_min_tokens..image_max_tokens`` (at most 4096); a fixed-size (``mlp``) projector whose images
    fall outside it is refused at start."""
    image_max_tokens: int | None = None
    """Most rows an image may become (see ``image_min_tokens``; a Qwen2-VL image is at least 8)."""
    media_url_fetch: bool = False
    """Head: fetch ``http(s)`` image URLs of the OpenAI API's ``image_url`` parts (at most 20 MB each,
    10 s). Off: only ``data:`` URLs, so a client cannot make the head reach other hosts."""
    bind_addr: str = "127.0.0.1:0"
    """Where the gRPC service listens (``host:port`` or ``tcp://host:port``; port 0: any). An address
    other hosts can reach needs a token or TLS (see ``allow_insecure``)."""
    upstream: PeerConfig | None = None
    """The stage above: ``{stage_id, stage_index, endpoint}``; unset on the head."""
    downstream: PeerConfig | None = None
    """The stage below; unset makes this the final stage (output head and sampling)."""
    downstream_alternates: tuple[PeerConfig, ...] = ()
    """Replacement stages serving the same layer range as the downstream, tried in order while the
    downstream does not answer (the head then re-prefills its sessions)."""
    return_to: PeerConfig | None = None
    """Final stage only: the head, to which this stage sends each batch's sampled tokens straight back.
    Unset: they travel back up the edges (one leg per stage)."""
    native_mtp_enabled: bool = False
    """Final stage only: load the model's multi-token-prediction (MTP, "next-n") layers and, with each
    sample, return their greedy guess of the token after it (a speculative draft the head may verify in
    its next step). Each decode then also leaves every row's last hidden state for them, as llama.cpp's own
    MTP driver does: logits are unchanged where every row is an output (one-token steps, verify and
    ``all_rows`` batches) and may move in the last bits for a prompt with only its last row out. Refused on
    a stage with a ``downstream``, and at load on a model without next-n layers
    (``<arch>.nextn_predict_layers``), with more than one (llama.cpp's MTP graph takes one) or with
    recurrent layers (no rewind, no speculation). The seed writes true by default; here it is off."""
    cache_dir: str | None = None
    """Where stage files are cached; unset: ``$SKIPPY_STAGE_CACHE`` or ``$XDG_CACHE_HOME/skippy-stage``."""
    wire_dtype: str = "f32"
    """How hidden states travel to the next stage: f32 (exact), f16, bf16 or int8 (smaller, lossy)."""
    hop_transport: str = "tcp"
    """How frames travel on this stage's edges (both ends of an edge must agree): "tcp", a
    length-prefixed connection to the neighbour's frame listener, or "stream", the gRPC ActivationStream."""
    native_frames: bool = True
    """Below the head: run plain decode frames (one position per bound session, f32 rows, plain TCP
    links; at the final stage greedy sampling) in compiled code rather than Python."""
    lone_steps: bool = True
    """Head: one greedy session alone runs its plain decode steps back to back in compiled code (with
    ``native_frames`` and a plain TCP link below)."""
    frame_port: int | None = None
    """The TCP frame listener's port on ``bind_addr``'s host; unset: any free port, advertised in
    GetStatus (fix it where a firewall or a Service must know it)."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest gRPC message or frame this stage sends or accepts; larger ones get RESOURCE_EXHAUSTED.
    At most 2 GiB - 1: gRPC counts a message's bytes in a signed 32-bit integer."""
    max_inflight: int = 4
    """Head: most batches in flight at once (disjoint session groups; at most ``lane_count`` of them).
    The head keeps as many as the links leave room for, from each step's measured time and the measured
    round trip to its downstream: one on loopback, more where a link's delay is a fair part of a step
    (and on hosts of their own, about one per stage). 1: one batch at a time."""
    verify_window_depth: int = 4
    """Head: most speculative verify windows of one session in flight (1..8). While a window is verified
    the head drafts the next from the guess that it is all kept and sends it; a window cut short makes the
    later ones stale (dropped, their rows rewound). Each session keeps as many as pay, measured from its
    drafts' acceptance and the chain's trip time (over slow links more); 1: one window per trip."""
    prefill_chunks_in_flight: int = 4
    """Head: most n_ubatch chunks of one prompt in flight down the chain (1..16). The next chunk leaves
    while the one before it is still on its way, so every stage works on one as soon as it is free and a
    link's delay is paid about once per prompt, not once per chunk; the chunks are those of one at a time
    (the same batches, the same numbers). 1: each chunk waits for the one before it to come back."""
    compute_lock_path: str | None = None
    """A lock file the stages on one host share: each takes it around every llama_decode, so only one
    computes at a time, on all its threads, where two at once would run more threads than the host has
    cores (they would wait for each other's descheduled threads at every barrier of the graph). The local
    launcher (``up``, ``demo``, ``bench``) sets it for such splits; unset: no lock (a stage alone on its
    host, or stages that fit its cores together)."""
    metrics_port: int | None = None
    """Prometheus metrics over HTTP on this port; unset: no metrics endpoint."""
    cpu_wake_latency_us: int | None = None
    """Hold the host's idle CPUs to waking within this many microseconds while the stage runs (the
    kernel's CPU latency QoS, /dev/cpu_dma_latency; 0: idle CPUs poll), so a frame does not wait for a
    halted CPU. Host-wide, costs idle power, needs write access to the device. Unset: the host's policy."""
    session_idle_ttl_s: float = 600.0
    """A session untouched for this long is freed (on every stage, each by its own clock), so a client
    or head that vanished never pins a lane; 0: never."""
    downstream_ready_timeout_s: float = 300.0
    """A stage whose downstream has not answered within this many seconds of loading exits non-zero
    (its orchestrator restarts it); later outages only make it NOT_SERVING."""
    tls_cert_path: str | None = None
    """TLS certificate to serve with (and to present downstream); set with ``tls_key_path``."""
    tls_key_path: str | None = None
    """The certificate's private key."""
    tls_ca_path: str | None = None
    """A CA: client certificates signed by it are required (mutual TLS) and the downstream is verified."""
    auth_token_path: str | None = None
    """A file holding the bearer token every RPC but Health must carry, and every frame link's hello
    (this stage sends it downstream too)."""
    allow_insecure: bool = False
    """A stage whose ``bind_addr`` other hosts can reach (not loopback) refuses to start without a token
    or TLS, since anyone who reaches its ports could otherwise feed it frames; true says the network
    itself is trusted (Redis's protected mode)."""
    peer_session_cap: int | None = None
    """Live sessions that the connections of one remote host may hold together unless they are this
    stage's chain (they presented the token or a certificate of ``tls_ca_path``, or without either their
    hello names the upstream's stage_id); unset: a quarter of ``lane_count``, at least 1. A connection's
    sessions are freed on every stage when it closes."""
    http_port: int | None = None
    """Head only: the OpenAI-compatible HTTP API on this port; unset: off."""
    admission_queue: int = 64
    """Head: generations waiting for a lane; beyond it a request gets RESOURCE_EXHAUSTED (HTTP 429)."""
    admission_wait_s: float = 30.0
    """Head: how long a generation may wait in the queue for a lane."""
    stream_interval_ms: float = 0.0
    """Head: a streamed generation's tokens that come within this many milliseconds of the last message
    go out together in the next one (the first token at once, the last at the end); 0: one message per
    token. Each message costs CPU that, on stages sharing a host's cores, slows the next decode."""
    recovery_wait_s: float = 15.0
    """A generation whose chain fails waits this long for it to come back, then re-prefills its tokens
    through it and continues; 0: fail at once."""
    hop_timeout_s: float = 30.0
    """One frame or control call to the downstream (capped further by the caller's deadline)."""
    health_probe_s: float = 1.0
    """One health probe of the downstream."""
    health_interval_s: float = 0.5
    """The pause between health probes of the downstream."""
    step_timeout_s: float = 60.0
    """Head: one generation step, end to end."""
    drop_timeout_s: float = 5.0
    """Freeing a finished session on every stage."""
    grpc_workers: int = 64
    """Threads serving gRPC calls (a Generate stream holds one for its whole length)."""
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    """Head only: speculative decoding ``{drafter, k, ngram, adaptive, model_path}``; requests may
    override all but model_path. Unset: none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bind_addr", strip_tcp_scheme(self.bind_addr))
        _validate(self)

    @property
    def include_embeddings(self) -> bool:
        """Stage 0 turns token ids into embeddings; no other stage does."""
        return self.layer_start == 0

    @property
    def include_output(self) -> bool:
        """The stage with nobody below it applies the output head."""
        return self.downstream is None

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def threads_batch(self) -> int:
        return self.n_threads if self.n_threads_batch is None else self.n_threads_batch

    def check_block_count(self, block_count: int) -> None:
        """Refuse a layer range that does not fit the model actually loaded."""
        if self.layer_end > block_count:
            raise ConfigError(
                f"stage {self.stage_id}: layer_end={self.layer_end} is beyond the model's "
                f"block count {block_count} (layer range {self.layer_start}:{self.layer_end})"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageConfig:
        """Build a config from JSON-shaped data, as the seed writes it.

        ``null`` means the field's default. Seed fields this stage does not act on yet are
        accepted at their default and refused by name otherwise (:data:`SEED_ONLY_FIELDS`).
        """
        if not isinstance(data, dict):
            raise ConfigError(f"stage config must be a JSON object, got {type(data).__name__}")
        stage_id = str(data.get("stage_id", "<unnamed>"))
        data = {k: v for k, v in data.items() if v is not None}
        if "package_ref" in data and "model_path" not in data:
            data["model_path"] = ""  # a package stage's model comes from the package
        for name in sorted(set(data) & set(SEED_ONLY_FIELDS)):
            _check_seed_only(stage_id, name, data.pop(name))
        if "selected_device" in data:
            data["selected_device"] = _device_name(data["selected_device"], stage_id=stage_id)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"stage {stage_id}: unknown config key(s) {', '.join(unknown)}")
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data
        ]
        if missing:
            raise ConfigError(f"stage {stage_id}: missing required config key(s) {', '.join(missing)}")
        values = dict(data)
        for side in ("upstream", "downstream", "return_to"):
            if values.get(side) is not None:
                values[side] = _peer(values[side], stage_id=stage_id, side=side)
        alternates = values.get("downstream_alternates", ())
        if not isinstance(alternates, (list, tuple)):
            raise ConfigError(f"stage {stage_id}: downstream_alternates must be a list, got {alternates!r}")
        values["downstream_alternates"] = tuple(
            _peer(a, stage_id=stage_id, side=f"downstream_alternates[{i}]") for i, a in enumerate(alternates)
        )
        if "speculative" in values:
            values["speculative"] = _speculative(values["speculative"], stage_id=stage_id)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> StageConfig:
        return dataclasses.replace(self, **changes)


def chain_links(stage_ids: Sequence[str], endpoints: Sequence[str], *,
                direct_return: bool = True) -> list[dict[str, dict[str, Any]]]:
    """Who each stage of a chain talks to, as StageConfig fields: ``upstream``, ``downstream``
    and, on the final stage when ``direct_return``, ``return_to`` the head. The one place a
    chain is wired (local pipelines, the planner's deployment files, the tests)."""
    def peer(j: int) -> dict[str, Any]:
        return {"stage_id": stage_ids[j], "stage_index": j, "endpoint": endpoints[j]}

    links: list[dict[str, dict[str, Any]]] = []
    for i in range(len(stage_ids)):
        link: dict[str, dict[str, Any]] = {}
        if i > 0:
            link["upstream"] = peer(i - 1)
        if i + 1 < len(stage_ids):
            link["downstream"] = peer(i + 1)
        elif i > 0 and direct_return:
            link["return_to"] = peer(0)
        links.append(link)
    return links


def load_config(path: str | os.PathLike[str]) -> StageConfig:
    """Read a StageConfig from a JSON file; errors name the file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read stage config {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"stage config {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"stage config {path} is not valid JSON: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # absurd nesting or integer length
        raise ConfigError(f"stage config {path} cannot be read as a config: {type(exc).__name__}") from exc
    return StageConfig.from_dict(data)


# The seed's StageConfig fields this stage implements (the rest of StageConfig is this project's own).
SEED_FIELDS = frozenset((
    "run_id", "topology_id", "model_id", "model_path", "stage_id", "stage_index", "layer_start", "layer_end",
    "ctx_size", "lane_count", "n_batch", "n_ubatch", "n_threads", "n_threads_batch", "n_gpu_layers", "mmap", "mlock",
    "direct_io", "repack", "check_tensors", "no_host_buffer", "op_offload", "cache_type_k", "cache_type_v",
    "flash_attn_type", "kv_offload", "kv_unified", "swa_full", "cache_idle_slots", "split_mode", "main_gpu",
    "selected_device", "load_mode", "bind_addr", "upstream", "downstream", "package_ref", "manifest_sha256",
    "checkpoint_quantization", "checkpoint_imatrix", "checkpoint_imatrix_sha256", "projector_path",
    "projector_use_gpu", "media_marker", "image_min_tokens", "image_max_tokens", "native_mtp_enabled",
))


@dataclass(frozen=True)
class SeedOnlyField:
    default: object
    why: str
    also_accepted: tuple[object, ...] = ()


# Fields of the seed's StageConfig that this stage does not act on (yet). A seed config
# spells them at their defaults, so they are accepted there; any other value would ask the
# stage to do something it cannot, so it is refused by name instead of ignored.
SEED_ONLY_FIELDS: dict[str, SeedOnlyField] = {
    "source_model_path": SeedOnlyField(None, "set model_path to the GGUF instead"),
    "source_model_sha256": SeedOnlyField(None, "source-model verification is not implemented"),
    "source_model_bytes": SeedOnlyField(None, "source-model verification is not implemented"),
    "materialized_path": SeedOnlyField(None, "materialized layer packages are not supported"),
    "materialized_pinned": SeedOnlyField(False, "materialized layer packages are not supported"),
    "batch_max_tokens": SeedOnlyField(None, "not implemented; n_batch bounds a batch"),
    "glm_dsa_policy": SeedOnlyField("auto", "GLM sparse attention policies are not implemented"),
    "generation_signal_window": SeedOnlyField(None, "generation signals are not implemented"),
    "filter_tensors_on_load": SeedOnlyField(False, "stages load a sliced file instead (load_mode runtime-slice)"),
    "resident_tensor_names": SeedOnlyField([], "stages load a sliced file instead (load_mode runtime-slice)"),
    "kv_cache": SeedOnlyField(None, "the resident KV cache is not implemented yet; use null or {\"mode\": \"disabled\"}"),
}


def _check_seed_only(stage_id: str, name: str, value: object) -> None:
    spec = SEED_ONLY_FIELDS[name]
    if name == "kv_cache" and isinstance(value, dict) and value.get("mode") == "disabled":
        return
    if value == spec.default and type(value) is type(spec.default):
        return
    if any(value == v and type(value) is type(v) for v in spec.also_accepted):
        return
    accepted = " or ".join(dict.fromkeys(json.dumps(v) for v in (spec.default, *spec.also_accepted, None)))
    raise ConfigError(
        f"stage {stage_id}: {name}={value!r} is a seed field this stage does not implement: {spec.why} "
        f"(accepted: {accepted})"
    )


def _device_name(raw: object, *, stage_id: str) -> object:
    """The seed's ``{"backend_device": NAME, "stable_id", "index", "vram_bytes"}`` -> NAME."""
    if not isinstance(raw, dict):
        return raw  # a name, or garbage that validation names
    allowed = {"backend_device", "stable_id", "index", "vram_bytes"}
    extra = sorted(set(raw) - allowed)
    if extra:
        raise ConfigError(f"stage {stage_id}: selected_device has unknown key(s) {', '.join(extra)}")
    name = raw.get("backend_device")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"stage {stage_id}: selected_device.backend_device must be a device name, got {name!r}")
    return name


def _peer(raw: object, *, stage_id: str, side: str) -> PeerConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"stage {stage_id}: {side} must be an object with stage_id, stage_index, endpoint, got {raw!r}")
    expected = {"stage_id", "stage_index", "endpoint"}
    if set(raw) != expected:
        raise ConfigError(
            f"stage {stage_id}: {side} must have exactly the keys stage_id, stage_index, endpoint, got {sorted(raw)}"
        )
    return PeerConfig(**raw)


def _speculative(data: object, *, stage_id: str) -> SpeculativeConfig:
    if isinstance(data, SpeculativeConfig):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"stage {stage_id}: speculative must be an object, got {data!r}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"stage {stage_id}: unknown speculative key(s) {', '.join(unknown)}")
    return SpeculativeConfig(**{k: v for k, v in data.items() if v is not None})


def _fail(cfg: StageConfig, field_name: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"stage {cfg.stage_id}: {field_name}={value!r} {why}")


def _require_int(cfg: StageConfig, name: str, minimum: int, *, optional: bool = False) -> None:
    value = getattr(cfg, name)
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(cfg, name, value, "must be an integer")
    if value < minimum:
        raise _fail(cfg, name, value, f"must be >= {minimum}")


def _require_bool(cfg: StageConfig, name: str, *, optional: bool = False) -> None:
    value = getattr(cfg, name)
    if optional and value is None:
        return
    if not isinstance(value, bool):
        raise _fail(cfg, name, value, "must be true or false")


def _require_str(cfg: StageConfig, name: str, *, optional: bool = False, choices: tuple[str, ...] = ()) -> None:
    value = getattr(cfg, name)
    if optional and value is None:
        return
    if not isinstance(value, str):
        raise _fail(cfg, name, value, "must be a string")
    if choices and value not in choices:
        raise _fail(cfg, name, value, f"must be one of {', '.join(choices)}")


def _validate_package(cfg: StageConfig) -> None:
    """package_ref and manifest_sha256 travel together, with load_mode artifact-slice."""
    _require_str(cfg, "package_ref", optional=True)
    _require_str(cfg, "manifest_sha256", optional=True)
    if cfg.package_ref is None:
        if cfg.manifest_sha256 is not None:
            raise _fail(cfg, "manifest_sha256", cfg.manifest_sha256, "is set without package_ref (the package it pins)")
        return
    scheme = _SCHEME.match(cfg.package_ref)
    if not cfg.package_ref or (scheme is not None and scheme["scheme"].lower() not in PACKAGE_SCHEMES):
        raise _fail(cfg, "package_ref", cfg.package_ref,
                    "is not a package directory or a file://, http:// or https:// URL of one")
    if cfg.manifest_sha256 is None:
        raise _fail(cfg, "manifest_sha256", None, f"must be set with package_ref={cfg.package_ref!r}: the sha256 of "
                    "its manifest.json, which `skippy-stage package` prints")
    if not _SHA256.fullmatch(cfg.manifest_sha256):
        raise _fail(cfg, "manifest_sha256", cfg.manifest_sha256, "is not a sha256 (64 hex digits)")
    if cfg.load_mode != "artifact-slice":
        raise _fail(cfg, "load_mode", cfg.load_mode, f"must be artifact-slice with package_ref={cfg.package_ref!r} "
                    "(the stage file is assembled from the package's parts)")


# The file types whose default tensor type llama.cpp makes only with an importance matrix
# (llama-quant.cpp's tensor_requires_imatrix).
IMATRIX_QUANTIZATIONS = ("IQ3_XXS", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")


def _validate_quantization(cfg: StageConfig) -> None:
    """checkpoint_quantization names a type this build makes; an imatrix travels with its sha256."""
    _require_str(cfg, "checkpoint_quantization")
    if cfg.checkpoint_quantization not in CHECKPOINT_QUANTIZATIONS:
        raise _fail(cfg, "checkpoint_quantization", cfg.checkpoint_quantization,
                    f"is not one of {', '.join(CHECKPOINT_QUANTIZATIONS)}")
    if (cfg.checkpoint_quantization != "preserve" and cfg.load_mode != "runtime-slice"
            and not (cfg.load_mode == "artifact-slice" and cfg.package_ref is not None)):
        # The whole model's type plan needs its header: the whole GGUF has it, and a package's
        # manifest and metadata part give it; a stage file alone does not.
        raise _fail(cfg, "checkpoint_quantization", cfg.checkpoint_quantization,
                    f"needs load_mode runtime-slice (the whole GGUF in model_path) or a package_ref, not "
                    f"{cfg.load_mode}" + (" with a stage file" if cfg.load_mode == "artifact-slice" else ""))
    _require_str(cfg, "checkpoint_imatrix", optional=True)
    _require_str(cfg, "checkpoint_imatrix_sha256", optional=True)
    if cfg.checkpoint_imatrix is None:
        if cfg.checkpoint_imatrix_sha256 is not None:
            raise _fail(cfg, "checkpoint_imatrix_sha256", cfg.checkpoint_imatrix_sha256,
                        "is set without checkpoint_imatrix (the file it pins)")
        if cfg.checkpoint_quantization in IMATRIX_QUANTIZATIONS:
            raise _fail(cfg, "checkpoint_imatrix", None, f"must name an importance matrix: llama.cpp makes "
                        f"checkpoint_quantization={cfg.checkpoint_quantization} only with one")
        return
    if cfg.checkpoint_quantization == "preserve":
        raise _fail(cfg, "checkpoint_imatrix", cfg.checkpoint_imatrix,
                    "is set but checkpoint_quantization is preserve (nothing is quantized)")
    if cfg.checkpoint_imatrix_sha256 is None or not _SHA256.fullmatch(cfg.checkpoint_imatrix_sha256):
        raise _fail(cfg, "checkpoint_imatrix_sha256", cfg.checkpoint_imatrix_sha256,
                    f"must be the sha256 (64 hex digits) of checkpoint_imatrix={cfg.checkpoint_imatrix!r}")


def _validate_media(cfg: StageConfig) -> None:
    """A projector on the head only, on the CPU, with a marker and a token budget that make sense."""
    _require_str(cfg, "projector_path", optional=True)
    _require_bool(cfg, "projector_use_gpu", optional=True)
    _require_str(cfg, "media_marker", optional=True)
    _require_int(cfg, "image_min_tokens", 1, optional=True)
    _require_int(cfg, "image_max_tokens", 1, optional=True)
    _require_bool(cfg, "media_url_fetch")
    if cfg.projector_path is None:
        for name in ("media_marker", "image_min_tokens", "image_max_tokens"):
            if getattr(cfg, name) is not None:
                raise _fail(cfg, name, getattr(cfg, name), "needs projector_path (no projector, no images)")
        return
    if cfg.projector_path == "":
        raise _fail(cfg, "projector_path", "", "must name an mmproj GGUF (or be unset)")
    if cfg.layer_start != 0:
        raise _fail(cfg, "projector_path", cfg.projector_path, f"is for the head only (layer_start=0), not a stage "
                    f"at layer_start={cfg.layer_start}: images are encoded where the prompt is")
    if cfg.projector_use_gpu:
        raise _fail(cfg, "projector_use_gpu", True, "this build runs the projector on the CPU only")
    if cfg.media_marker == "":
        raise _fail(cfg, "media_marker", "", "must be a non-empty string (or unset)")
    if cfg.image_min_tokens is not None and cfg.image_max_tokens is not None \
            and cfg.image_min_tokens > cfg.image_max_tokens:
        raise _fail(cfg, "image_min_tokens", cfg.image_min_tokens,
                    f"is above image_max_tokens={cfg.image_max_tokens}")


def _validate(cfg: StageConfig) -> None:
    if not isinstance(cfg.stage_id, str) or not cfg.stage_id:
        raise ConfigError(f"stage_id must be a non-empty string, got {cfg.stage_id!r}")
    for name in ("model_path", "run_id", "topology_id", "model_id"):
        _require_str(cfg, name)
    if not cfg.model_path and cfg.package_ref is None:
        raise _fail(cfg, "model_path", cfg.model_path, "must name a GGUF file (or package_ref a layer package)")
    for name in ("stage_index", "layer_start", "main_gpu"):
        _require_int(cfg, name, 0)
    _require_int(cfg, "n_gpu_layers", -1)  # -1: offload every layer
    _require_int(cfg, "layer_end", 1)
    if cfg.layer_end <= cfg.layer_start:
        raise ConfigError(
            f"stage {cfg.stage_id}: layer range {cfg.layer_start}:{cfg.layer_end} is empty "
            f"(layer_end={cfg.layer_end} must be > layer_start={cfg.layer_start})"
        )
    _require_int(cfg, "ctx_size", 1, optional=True)
    for name in ("lane_count", "n_batch", "n_ubatch", "n_threads"):
        _require_int(cfg, name, 1)
    _require_int(cfg, "n_threads_batch", 1, optional=True)
    _require_int(cfg, "max_message_bytes", 1024)
    if cfg.max_message_bytes > MAX_MESSAGE_BYTES:
        raise _fail(cfg, "max_message_bytes", cfg.max_message_bytes,
                    f"must be <= {MAX_MESSAGE_BYTES} (2 GiB - 1: gRPC counts message bytes in a signed 32-bit int)")
    _require_int(cfg, "max_inflight", 1)
    _require_int(cfg, "verify_window_depth", 1)
    _require_int(cfg, "prefill_chunks_in_flight", 1)
    if cfg.prefill_chunks_in_flight > MAX_PREFILL_CHUNKS_IN_FLIGHT:
        raise _fail(cfg, "prefill_chunks_in_flight", cfg.prefill_chunks_in_flight,
                    f"must be <= {MAX_PREFILL_CHUNKS_IN_FLIGHT}")
    if cfg.verify_window_depth > MAX_VERIFY_WINDOW_DEPTH:
        raise _fail(cfg, "verify_window_depth", cfg.verify_window_depth, f"must be <= {MAX_VERIFY_WINDOW_DEPTH}")
    for name in ("metrics_port", "http_port", "frame_port"):
        _require_int(cfg, name, 0, optional=True)
        if getattr(cfg, name) is not None and getattr(cfg, name) > 65535:
            raise _fail(cfg, name, getattr(cfg, name), "must be a TCP port (0..65535)")
    _require_int(cfg, "cpu_wake_latency_us", 0, optional=True)
    if cfg.cpu_wake_latency_us is not None and cfg.cpu_wake_latency_us > WAKE_LATENCY_MAX_US:
        raise _fail(cfg, "cpu_wake_latency_us", cfg.cpu_wake_latency_us, f"must be <= {WAKE_LATENCY_MAX_US}")
    if cfg.http_port is not None and cfg.layer_start != 0:
        raise _fail(cfg, "http_port", cfg.http_port, "is served by the head stage only (layer_start=0)")
    _require_int(cfg, "admission_queue", 0)
    for name in ("admission_wait_s", "downstream_ready_timeout_s"):
        wait = getattr(cfg, name)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait <= 86400:
            raise _fail(cfg, name, wait, "must be a number of seconds in (0, 86400]")
    ttl = cfg.session_idle_ttl_s
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl <= 86400:
        raise _fail(cfg, "session_idle_ttl_s", ttl, "must be a number of seconds in [0, 86400] (0: never expire)")
    interval = cfg.stream_interval_ms
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval <= MAX_STREAM_INTERVAL_MS:
        raise _fail(cfg, "stream_interval_ms", interval, f"must be a number of milliseconds in [0, {MAX_STREAM_INTERVAL_MS}]")
    if isinstance(cfg.recovery_wait_s, bool) or not isinstance(cfg.recovery_wait_s, (int, float)) \
            or not 0 <= cfg.recovery_wait_s <= 3600:
        raise _fail(cfg, "recovery_wait_s", cfg.recovery_wait_s, "must be a number of seconds in [0, 3600]")
    for name, limit in (("hop_timeout_s", 3600), ("health_probe_s", 60), ("health_interval_s", 60),
                        ("step_timeout_s", 3600), ("drop_timeout_s", 600)):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= limit:
            raise _fail(cfg, name, value, f"must be a number of seconds in (0, {limit}]")
    _require_int(cfg, "grpc_workers", 1)
    if cfg.grpc_workers > 1024:
        raise _fail(cfg, "grpc_workers", cfg.grpc_workers, "must be <= 1024")
    _require_int(cfg, "cache_idle_slots", 0, optional=True)
    _require_int(cfg, "peer_session_cap", 0, optional=True)
    if cfg.peer_session_cap is not None and cfg.peer_session_cap > cfg.lane_count:
        raise _fail(cfg, "peer_session_cap", cfg.peer_session_cap, f"must be <= lane_count={cfg.lane_count}")
    spec = cfg.speculative
    if not isinstance(spec, SpeculativeConfig):
        raise _fail(cfg, "speculative", spec, "must be an object (drafter, k, ngram, adaptive, model_path)")
    if (problem := spec.problem()) is not None:
        raise ConfigError(f"stage {cfg.stage_id}: speculative.{problem}")
    if spec.enabled and cfg.layer_start != 0:
        raise _fail(cfg, "speculative.drafter", spec.drafter, "is set on a stage that is not the head (layer_start=0): "
                    "the head drafts")
    _require_bool(cfg, "native_mtp_enabled")
    if cfg.native_mtp_enabled and not cfg.include_output:
        raise _fail(cfg, "native_mtp_enabled", True, "is for the final stage only (no downstream): the MTP "
                    "layers draft from the trunk's last hidden state, which only the final stage computes")
    if spec.drafter == "model" and not spec.model_path:
        raise _fail(cfg, "speculative.model_path", spec.model_path, "must name the draft GGUF for drafter 'model'")
    if spec.drafter != "model" and spec.model_path:
        raise _fail(cfg, "speculative.model_path", spec.model_path, f"is set but drafter={spec.drafter!r} loads no model")
    if cfg.n_ubatch > cfg.n_batch:
        raise _fail(cfg, "n_ubatch", cfg.n_ubatch, f"must be <= n_batch={cfg.n_batch}")
    if cfg.lane_count > MAX_LANES:
        raise _fail(cfg, "lane_count", cfg.lane_count, f"must be <= {MAX_LANES} (llama.cpp's sequence limit)")
    if cfg.lane_count > cfg.n_ubatch:
        # llama.cpp's equal split cannot place more sequences than n_ubatch in one micro-batch.
        raise _fail(cfg, "lane_count", cfg.lane_count, f"must be <= n_ubatch={cfg.n_ubatch}")
    if not cfg.kv_unified and cfg.ctx_size is not None and cfg.ctx_size < cfg.lane_count:
        raise _fail(cfg, "ctx_size", cfg.ctx_size, f"leaves no KV cells per lane for lane_count={cfg.lane_count}")
    if cfg.cache_idle_slots is not None and cfg.cache_idle_slots > cfg.lane_count:
        raise _fail(cfg, "cache_idle_slots", cfg.cache_idle_slots, f"must be <= lane_count={cfg.lane_count}")
    for name in ("mlock", "direct_io", "repack", "check_tensors", "no_host_buffer", "kv_offload", "kv_unified",
                 "swa_full", "native_frames", "lone_steps", "allow_insecure"):
        _require_bool(cfg, name)
    for name in ("mmap", "op_offload"):
        _require_bool(cfg, name, optional=True)
    if cfg.direct_io and (cfg.mmap or cfg.mlock):
        raise _fail(cfg, "direct_io", cfg.direct_io,
                    f"cannot be combined with mmap={cfg.mmap} or mlock={cfg.mlock} (llama.cpp reads the file one way)")
    for name in ("cache_type_k", "cache_type_v"):
        value = getattr(cfg, name)
        if value not in CACHE_TYPES:
            raise ConfigError(
                f"parse {name} for {cfg.stage_id}: {value!r} is not one of {', '.join(CACHE_TYPES)}"
            )
    _require_str(cfg, "flash_attn_type", choices=FLASH_ATTN_TYPES)
    if cfg.cache_type_v not in ("f32", "f16", "bf16") and cfg.flash_attn_type == "disabled":
        raise _fail(cfg, "cache_type_v", cfg.cache_type_v, "is quantized, which llama.cpp allows only with flash attention")
    _require_str(cfg, "split_mode", choices=SPLIT_MODES)
    _require_str(cfg, "selected_device", optional=True)
    if cfg.selected_device == "":
        raise _fail(cfg, "selected_device", cfg.selected_device, "must name a backend device (skippy-stage info lists them)")
    _require_str(cfg, "cache_dir", optional=True)
    _require_str(cfg, "compute_lock_path", optional=True)
    if cfg.compute_lock_path == "":
        raise _fail(cfg, "compute_lock_path", cfg.compute_lock_path, "must name a file (or be unset)")
    _require_str(cfg, "wire_dtype", choices=WIRE_DTYPES)
    if cfg.hop_transport == "unary":
        raise _fail(cfg, "hop_transport", cfg.hop_transport,
                    "is no longer a frame transport (frames flow one way; a unary call waits for its answer): "
                    "use 'tcp' or 'stream'")
    _require_str(cfg, "hop_transport", choices=HOP_TRANSPORTS)
    for name in ("tls_cert_path", "tls_key_path", "tls_ca_path", "auth_token_path"):
        _require_str(cfg, name, optional=True)
    if (cfg.tls_cert_path is None) != (cfg.tls_key_path is None):
        raise _fail(cfg, "tls_cert_path" if cfg.tls_cert_path is None else "tls_key_path", None,
                    "must be set together with its pair (tls_cert_path and tls_key_path)")
    if cfg.tls_ca_path is not None and cfg.tls_cert_path is None:
        raise _fail(cfg, "tls_ca_path", cfg.tls_ca_path, "needs tls_cert_path and tls_key_path (mutual TLS)")
    _require_str(cfg, "load_mode", choices=LOAD_MODES)
    if cfg.load_mode == "layer-package":
        raise _fail(cfg, "load_mode", cfg.load_mode, "is refused: layer-package schema v1 is offline-only")
    _validate_package(cfg)
    _validate_quantization(cfg)
    _validate_media(cfg)
    parse_endpoint(cfg.bind_addr, stage_id=cfg.stage_id, field_name="bind_addr", allow_port_zero=True)
    for side, offset in (("upstream", -1), ("downstream", 1)):
        peer = getattr(cfg, side)
        if peer is None:
            continue
        if not isinstance(peer, PeerConfig):
            raise _fail(cfg, side, peer, "must be an object with stage_id, stage_index, endpoint")
        if not isinstance(peer.stage_id, str) or not peer.stage_id:
            raise _fail(cfg, f"{side}.stage_id", peer.stage_id, "must be a non-empty string")
        if not isinstance(peer.stage_index, int) or isinstance(peer.stage_index, bool):
            raise _fail(cfg, f"{side}.stage_index", peer.stage_index, "must be an integer")
        if peer.stage_index != cfg.stage_index + offset:
            raise _fail(
                cfg, f"{side}.stage_index", peer.stage_index, f"must be {cfg.stage_index + offset} (stage_index{offset:+d})"
            )
        parse_endpoint(peer.endpoint, stage_id=cfg.stage_id, field_name=f"{side}.endpoint")
    if cfg.downstream_alternates and cfg.downstream is None:
        raise _fail(cfg, "downstream_alternates", len(cfg.downstream_alternates), "needs a downstream to stand in for")
    for i, alt in enumerate(cfg.downstream_alternates):
        if not isinstance(alt, PeerConfig) or alt.stage_index != cfg.stage_index + 1:
            raise _fail(cfg, f"downstream_alternates[{i}].stage_index", getattr(alt, "stage_index", alt),
                        f"must be {cfg.stage_index + 1}")
        parse_endpoint(alt.endpoint, stage_id=cfg.stage_id, field_name=f"downstream_alternates[{i}].endpoint")
    if cfg.return_to is not None:
        if not isinstance(cfg.return_to, PeerConfig):
            raise _fail(cfg, "return_to", cfg.return_to, "must be an object with stage_id, stage_index, endpoint")
        if cfg.downstream is not None or cfg.layer_start == 0:
            raise _fail(cfg, "return_to", cfg.return_to.stage_id,
                        "is only for the final stage of a split (no downstream, layer_start > 0)")
        if cfg.return_to.stage_index != 0:
            raise _fail(cfg, "return_to.stage_index", cfg.return_to.stage_index, "must be 0 (the head)")
        parse_endpoint(cfg.return_to.endpoint, stage_id=cfg.stage_id, field_name="return_to.endpoint")
    if cfg.layer_start == 0 and cfg.upstream is not None:
        raise _fail(cfg, "upstream", cfg.upstream.stage_id, "must be unset for the head stage (layer_start=0)")
