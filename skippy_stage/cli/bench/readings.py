"""What the bench reads off running processes: each thread's CPU time from /proc, and a stage's
histograms from its /metrics, with the arithmetic that turns two readings into per-token figures."""

from __future__ import annotations

from pathlib import Path

THREAD_KEYS = ("decoding", "other", "decoding_wait")


def thread_times(pid: int) -> dict[int, tuple[int, int]]:
    """Every thread of ``pid``: (ns on a CPU, ns runnable but waiting for one), from schedstat."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu, wait, _ = (int(v) for v in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        out[int(task.name)] = (cpu, wait)
    return out


def thread_split(delta: dict[int, tuple[int, int]], n_tokens: int, decoding: int) -> dict[str, float]:
    """us per token of one process's CPU (``delta``: each thread's ns on a CPU and ns waiting for
    one): its ``decoding`` busiest threads (the decode's OpenMP team, the thread that calls
    llama_decode included: its Python between decodes counts here), the rest of its threads (gRPC,
    the stream, listeners, timers), and how long the decoding threads were runnable but waited
    for a core (preempted, or woken onto a busy one). A difference of two runs' counts can come
    out below 0 for a thread that happened to do more in the shorter run (a timer, a probe):
    counted as 0, as a thread cannot spend less than nothing."""
    rows = sorted(((max(cpu, 0), max(wait, 0)) for cpu, wait in delta.values()), reverse=True)
    per = 1e-3 / n_tokens
    return {"decoding": sum(r[0] for r in rows[:decoding]) * per, "other": sum(r[0] for r in rows[decoding:]) * per,
            "decoding_wait": sum(r[1] for r in rows[:decoding]) * per}


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("skippy_") and " " in line:
            name, _, number = line.rpartition(" ")
            values[name] = float(number)
    return values


_KINDS = ("compute", "forward_hop", "hop_latency")


def _histogram_sums(port: int) -> dict[str, object]:
    """(sum, count) of the compute, forward-hop and hop-latency histograms of one stage, and
    the hop-latency bucket counts (for a median)."""
    values = _scrape(port)
    out: dict[str, object] = {
        kind: (values.get(f"skippy_{kind}_seconds_sum", 0.0), values.get(f"skippy_{kind}_seconds_count", 0.0))
        for kind in _KINDS
    }
    prefix = 'skippy_hop_latency_seconds_bucket{le="'
    out["hop_latency_buckets"] = sorted(
        (float(name[len(prefix):-2]), count) for name, count in values.items() if name.startswith(prefix))
    return out


def _mean_delta(before: dict, after: dict, kind: str) -> float:
    (s1, c1), (s0, c0) = after[kind], before[kind]
    return (s1 - s0) / (c1 - c0) if c1 > c0 else 0.0


def hop_overheads_us(before: list[dict], after: list[dict]) -> list[float]:
    """What one leg costs, from the stages' own histograms: the head's wait for a step's
    outputs minus what the stages below spent computing, over the legs a token travels
    (one per stage: down every edge, then back to the head).

    What is left is the transport's own cost: serialisation, the network stack, thread
    hand-offs and scheduling.
    """
    n = len(after)
    waited = _mean_delta(before[0], after[0], "forward_hop")
    below = sum(_mean_delta(before[k], after[k], "compute") for k in range(1, n))
    return [(waited - below) / n * 1e6]


def hop_latency_median_us(before: list[dict], after: list[dict]) -> float:
    """Median of "frame handed to the transport -> compute starts at the next stage" over every
    stage below the head in one run, interpolated within the histogram's buckets."""
    total: dict[float, float] = {}
    for b, a in zip(before[1:], after[1:]):
        for (le, c1), (_, c0) in zip(a["hop_latency_buckets"], b["hop_latency_buckets"]):
            total[le] = total.get(le, 0.0) + c1 - c0
    buckets = sorted(total.items())
    if not buckets or buckets[-1][1] == 0:
        return 0.0
    half = buckets[-1][1] / 2
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= half:
            if le == float("inf"):
                return lower_le * 1e6
            span = count - lower_count
            return (lower_le + (le - lower_le) * ((half - lower_count) / span if span else 0.0)) * 1e6
        lower_le, lower_count = le, count
    return lower_le * 1e6


def _subtract(total: dict[int, tuple[int, int]], part: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Per thread, ``total`` minus ``part`` (a thread ``part`` lacks counts from 0): a later
    ``thread_times`` reading minus an earlier one, or one run's counts minus another's."""
    return {tid: (t[0] - part.get(tid, (0, 0))[0], t[1] - part.get(tid, (0, 0))[1]) for tid, t in total.items()}


def _shifted(before: dict, part_before: dict, part_after: dict) -> dict:
    """``before`` moved on by what happened between ``part_before`` and ``part_after``: taken
    off a later reading, it leaves what happened since ``before`` except that part."""
    out: dict[str, object] = {kind: tuple(b + pa - pb for b, pb, pa in zip(before[kind], part_before[kind], part_after[kind]))
                              for kind in _KINDS}
    out["hop_latency_buckets"] = [(le, c + pa - pb) for (le, c), (_, pb), (_, pa)
                                  in zip(before["hop_latency_buckets"], part_before["hop_latency_buckets"],
                                         part_after["hop_latency_buckets"])]
    return out
