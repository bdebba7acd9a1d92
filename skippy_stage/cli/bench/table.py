"""The report as the table ``bench`` prints: each figure beside the single process's, with the
ratio and its target."""

from __future__ import annotations

from skippy_stage.cli.bench.mtp import RANDOM_NOTE


def format_table(report: dict[str, object]) -> str:
    """The sections the report holds, each as its rows (the host's settings always)."""
    r = report
    lines = []
    if {"pipeline_ms_per_token", "aggregate_tokens_per_s", "chat_ttft_s", "speculative", "images", "mtp",
            "repack"} & set(r):
        lines.append(f"{'measure':44} {'pipeline':>12} {'single':>12} {'ratio':>8} {'target':>8}")
    if "pipeline_ms_per_token" in r:
        lines += _decode_lines(r)
    if "aggregate_tokens_per_s" in r:
        lines += _batched_lines(r)
    if "chat_ttft_s" in r:
        lines += _chat_lines(r)
    if "speculative" in r:
        lines += _speculative_lines(r)
    if "images" in r:
        lines += images_lines(r["images"])
    if "mtp" in r:
        lines += mtp_lines(r["mtp"])
    if "pipeline_ms_per_token" in r:
        lines += _transport_lines(r)
    if "hop_floor_us" in r:
        lines += _floor_lines(r)
    if "pipeline_ms_per_token" in r:
        lines += _cpu_lines(r)
    lines += _host_lines(r)
    if "repack" in r:
        lines += _repack_lines(r)
    if "wan" in r:
        lines += wan_lines(r["wan"])
    return "\n".join(lines)


def _decode_lines(r: dict) -> list[str]:
    ratios = r["ratios"]
    return [
        f"{'decode ms/token, 2 stages':44} {r['pipeline_ms_per_token']['2']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_2_stage']:8.2f} {'>=0.95':>8}",
        f"{'decode ms/token, 3 stages':44} {r['pipeline_ms_per_token']['3']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_3_stage']:8.2f} {'>=0.90':>8}",
        f"{'decode ms/token, 1 stage (this stack, unsplit)':44} {r['one_stage_ms_per_token']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_1_stage']:8.2f}",
        f"{'decode ms/token, 2 stages, whole completion':44} {r['whole_completion_ms_per_token']['2']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_2_stage_whole_completion']:8.2f}",
        f"{'decode ms/token, 3 stages, whole completion':44} {r['whole_completion_ms_per_token']['3']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_3_stage_whole_completion']:8.2f}",
        f"{'decode, 2 / 3 stages vs 1 stage (the split alone)':44} {'':>12} {'':>12} "
        f"{ratios['decode_2_stage_vs_1_stage']:5.2f} / {ratios['decode_3_stage_vs_1_stage']:.2f}",
        f"{'per-hop overhead (us, 3-stage excess / 3 legs)':44} {r['per_hop_overhead_us']:12.0f}",
        f"{'per-hop overhead (us, from stage histograms)':44} {r['per_hop_overhead_us_histograms']:12.0f}",
        f"{'split cost per extra stage (us, client view)':44} {r['split_cost_us_per_extra_stage']:12.0f}",
    ]


def _batched_lines(r: dict) -> list[str]:
    ratios = r["ratios"]
    agg = r["aggregate_tokens_per_s"]
    lines = []
    for c in ("1", "4", "8"):
        lines.append(f"{'aggregate tok/s, concurrency ' + c:44} {agg['pipeline'][c]:12.1f} "
                     f"{agg['single_process'][c]:12.1f} {agg['pipeline'][c] / agg['single_process'][c]:8.2f}"
                     f" {'>=0.85' if c == '8' else '':>8}")
    lines.append(f"{'aggregate 8 vs pipeline 1':44} {'':>12} {'':>12} {ratios['aggregate_8_vs_pipeline_1']:8.2f} {'>=1.5':>8}")
    p = r["prefill_tokens_per_s"]
    lines.append(f"{'prefill tok/s, 512-token prompt':44} {p['pipeline']:12.1f} {p['single_process']:12.1f} "
                 f"{ratios['prefill_512']:8.2f} {'>=0.95':>8}")
    return lines


def _chat_lines(r: dict) -> list[str]:
    ratios = r["ratios"]
    lines = []
    chat = r["chat_ttft_s"]
    lines.append(f"{'chat turn 4 TTFT s, no prefix cache / cache':44} {chat['without_prefix_cache'][-1]:12.3f} "
                 f"{chat['with_prefix_cache'][-1]:12.3f} {ratios['chat_turn4_ttft_without_vs_with_prefix_cache']:8.2f} "
                 f"{'>=3':>8}")
    lines.append("chat TTFT s per turn, with prefix cache: " + ", ".join(f"{t:.3f}" for t in chat["with_prefix_cache"])
                 + "; without: " + ", ".join(f"{t:.3f}" for t in chat["without_prefix_cache"]))
    return lines


def _speculative_lines(r: dict) -> list[str]:
    lines = []
    for name, target in (("repetitive", ">=1.8"), ("free_form", ">=0.95")):
        s = r["speculative"][name]
        lines.append(f"{'speculative ngram, ' + name + ' (ms/token)':44} {s['ngram']['ms_per_token']:12.2f} "
                     f"{s['none']['ms_per_token']:12.2f} {s['speedup']:8.2f} {target:>8}")
        lines.append(f"  ngram: {s['ngram']['tokens_per_trip']:.2f} tokens per trip of {s['ngram']['rows_per_trip']:.2f} rows, "
                     f"a trip costing {s['trip_cost_ratio']:.2f}x a plain one (ratio column: tokens/s with ngram over "
                     f"without, 3 stages)")
    return lines


def images_lines(images: dict) -> list[str]:
    """The ``images`` section: the head's encode and a prompt's first token, against one process."""
    e, t = images["encode_ms_per_image"], images["ttft_ms_one_image"]
    n = len(images["stages"])
    return [
        f"{'image encode ms per image, head / one process':44} {e['head']:12.2f} {e['single_process']:12.2f} "
        f"{e['ratio']:8.2f}",
        f"{'TTFT ms, one image, ' + str(n) + ' stages / one process':44} {t['pipeline']:12.2f} "
        f"{t['single_process']:12.2f} {t['ratio']:8.2f}",
        f"  images: {images['image']}, {images['projector']}, {images['prompt_tokens']} prompt positions; "
        f"one process: prefill from empty (without the bench's extra encode; "
        f"{t['single_process_prefill_with_extra_encode']:.2f} ms with it); medians of {images['rounds']} "
        f"round{'s' if images['rounds'] != 1 else ''} (ratio column: one process over the pipeline)",
        *mrope_lines(images.get("mrope_encode_ms_per_image")),
    ]


def mrope_lines(mrope: dict | None) -> list[str]:
    """The Qwen2-VL encode of the ``images`` section, or why it did not run."""
    if mrope is None:
        return []
    if "skipped" in mrope:
        return [f"Qwen2-VL image encode: skipped ({mrope['skipped']})"]
    return [f"{'Qwen2-VL image encode ms, head / one process':44} {mrope['head']:12.2f} "
            f"{mrope['single_process']:12.2f} {mrope['ratio']:8.2f}",
            f"  Qwen2-VL: {mrope['image']} ({mrope['grid']} grid, {mrope['rows']} rows), {mrope['model']}"]


def mtp_lines(mtp: dict) -> list[str]:
    """The ``mtp`` section, or why it did not run."""
    if "skipped" in mtp:
        return [f"mtp drafting: skipped ({mtp['skipped']})"]
    n = len(mtp["stages"])
    single, ratios = mtp["single_process_ms_per_token"], mtp["ratios"]
    acceptance = (f"drafts kept {mtp['accepted']:.0f}/{mtp['drafted']:.0f} ({mtp['acceptance']:.0%})"
                  + (f" -- {RANDOM_NOTE}" if mtp["random_weights"] else ""))
    return [
        f"{'mtp ms/token, ' + str(n) + ' stages, drafter mtp':44} {mtp['mtp']['ms_per_token']:12.2f} {single:12.2f} "
        f"{ratios['mtp_vs_single_process']:8.2f}",
        f"{'mtp ms/token, ' + str(n) + ' stages, drafter none':44} {mtp['none']['ms_per_token']:12.2f} {single:12.2f} "
        f"{ratios['none_vs_single_process']:8.2f}",
        f"  mtp: tokens/s with mtp over none {ratios['mtp_vs_none']:.2f}; {mtp['mtp']['tokens_per_trip']:.2f} tokens "
        f"per trip (none {mtp['none']['tokens_per_trip']:.2f}); {acceptance}",
        f"  model {mtp['model']}, stages {', '.join(f'{a}:{b}' for a, b in mtp['stages'])}; {mtp['tokens']} tokens, "
        f"medians of {mtp['rounds']} round{'s' if mtp['rounds'] != 1 else ''}",
    ]


def _transport_lines(r: dict) -> list[str]:
    lines = []
    lines.append(f"{'hop latency (us, send -> next stage computes)':44} {r['hop_latency_us']:12.0f} "
                 f"{'':>12} {'':>8} {'<=200':>8}")
    for transport, t in r["transport_comparison_3_stage"].items():
        default = " (default)" if transport == r["hop_transport_default"] else ""
        lines.append(f"3 stages over {transport:6}: {t['ms_per_token']:.2f} ms/token, per-hop overhead "
                     f"{t['per_hop_overhead_us']:.0f} us, hop latency {t['hop_latency_us']:.0f} us{default}")
    si = r["stream_interval_2_stage"]
    lines.append(f"2 stages, a client message per token: {si['each_token_ms_per_token']:.2f} ms/token "
                 f"({si['single_process_ms_per_token'] / si['each_token_ms_per_token']:.2f}); tokens within "
                 f"{si['interval_ms']:.0f} ms sent together (stream_interval_ms): {si['interval_ms_per_token']:.2f} "
                 f"ms/token ({si['single_process_ms_per_token'] / si['interval_ms_per_token']:.2f})")
    cp = r["client_priority_2_stage"]
    lines.append(f"2 stages, the client in the bench's process at normal priority: {cp['local_ms_per_token']:.2f} "
                 f"ms/token ({cp['single_process_ms_per_token'] / cp['local_ms_per_token']:.2f}); in its own at "
                 f"nice 19 (every decode figure): {cp['quiet_ms_per_token']:.2f} ms/token "
                 f"({cp['single_process_ms_per_token'] / cp['quiet_ms_per_token']:.2f}); reading nothing until "
                 f"the end (timed at the head): {cp['held_ms_per_token']:.2f} ms/token "
                 f"({cp['single_process_ms_per_token'] / cp['held_ms_per_token']:.2f})")
    fp = r["frame_path_comparison_3_stage"]
    lines.append(f"3 stages, frames below the head in Python: {fp['python_ms_per_token']:.2f} ms/token; "
                 f"in C where plain: {fp['native_ms_per_token']:.2f} ms/token"
                 f"{' (default)' if r['native_frames'] else ' (not built here: both ran Python)'}")
    rp = r["return_path_comparison_3_stage"]
    lines.append(f"3 stages, tokens relayed back: {rp['relay_ms_per_token']:.2f} ms/token; "
                 f"straight to the head: {rp['direct_ms_per_token']:.2f} ms/token (medians, interleaved runs)")
    return lines


def _floor_lines(r: dict) -> list[str]:
    lines = []
    floor = r["hop_floor_us"]
    lines.append(f"hop floor, 2304-byte frame to another process and back: grpcio stream "
                 f"{floor['grpc_stream_round_trip_us']:.0f} us, TCP frames {floor['tcp_frame_round_trip_us']:.0f} us, "
                 f"bare TCP socket {floor['tcp_socket_round_trip_us']:.0f} us")
    wake = r["wake_floor_us"]
    held = r["cpu_wake_latency_us"]
    lines.append(f"wake of a sleeping receiver, one-way (sender busy 3 ms between sends): host idle policy "
                 f"{wake['host_policy']:.0f} us" + (f", idle CPUs held to 0 us {wake['held_0_us']:.0f} us"
                                                    if "held_0_us" in wake else "")
                 + f"; bench stages held cpu_wake_latency_us={'unset (host policy)' if held is None else held}")
    return lines


def _cpu_lines(r: dict) -> list[str]:
    lines = []
    for n, cpu in r["stage_cpu_ms_per_token"].items():
        lines.append(f"CPU ms per token by stage, {n} stages: " + ", ".join(f"{c:.2f}" for c in cpu))
    by_thread = r["token_cpu_us_by_thread"]
    base = by_thread["single"][0]["decoding"] + by_thread["single"][0]["other"]
    for n, procs in by_thread.items():
        total = sum(p["decoding"] + p["other"] for p in procs)
        name = "single process" if n == "single" else f"{n} stage{'s' if n != '1' else ''}"
        lines.append(f"CPU us per token, {name}: " + "; ".join(
            f"{p['decoding']:.0f} decoding (waited {p['decoding_wait']:.0f}) + {p['other']:.0f} other" for p in procs)
            + ("" if n == "single" else f" = {total:.0f}, {total - base:+.0f} vs single"))
    for n, by_stage in r["stage_compute_ms_by_stage"].items():
        lines.append(f"compute ms per token by stage, {n} stages: " + ", ".join(f"{c:.2f}" for c in by_stage)
                     + f" (sum {r['stage_compute_ms_per_token'][n]:.2f}; single process "
                       f"{r['single_process_ms_per_token']:.2f} in all)")
    return lines


def _host_lines(r: dict) -> list[str]:
    lines = []
    spin, policy, bind = r["openmp_spincount"], r["openmp_wait_policy"], r["openmp_proc_bind"]
    lines.append(f"OpenMP spin count: stages {spin['stages']}, single process {spin['single_process']}; wait policy: "
                 f"stages {policy['stages']}, single process {policy['single_process']}; threads "
                 f"bound: stages {bind['stages']}, single process {bind['single_process']}; "
                 f"{'each stage from its own core' if r.get('openmp_places_by_stage') else 'every stage from the first core'}; "
                 f"hidden-state capture {r['hidden_state_capture']}")
    threads = r["cpu_threads"]
    if threads != "openmp":
        lines.append(f"CPU graphs on llama.cpp built without OpenMP: stages {threads['stages']}, single process "
                     f"{threads['single_process']} (the OpenMP settings above do nothing)")
    lines.append("wire bytes/token: " + ", ".join(f"{k} {v}" for k, v in r["wire_bytes_per_token"].items()))
    return lines


def _repack_lines(r: dict) -> list[str]:
    lines = []
    rp = r["repack"]
    if "skipped" in rp:
        lines.append(f"repack on vs off: skipped ({rp['skipped']})")
    else:
        for way in ("off", "on"):
            w = rp[way]
            lines.append(f"{'decode ms/token, repack ' + way + ', 2 stages':44} {w['pipeline_ms_per_token']:12.2f} "
                         f"{w['single_process_ms_per_token']:12.2f} {w['decode_ratio']:8.2f}")
            lines.append(f"{'prefill tok/s, repack ' + way + ', ' + str(rp['prefill_tokens']) + '-token prompt':44} "
                         f"{w['pipeline_prefill_tokens_per_s']:12.1f} {w['single_process_prefill_tokens_per_s']:12.1f} "
                         f"{w['prefill_ratio']:8.2f}")
        v = rp["on_vs_off"]
        lines.append(f"repack on vs off ({rp['model']}; above 1: on is faster): decode {v['pipeline_decode']:.2f} "
                     f"(single process {v['single_process_decode']:.2f}), prefill {v['pipeline_prefill']:.2f} "
                     f"(single process {v['single_process_prefill']:.2f})")
    return lines


def wan_lines(wan: dict) -> list[str]:
    """The ``wan`` section: a column per one-way delay, the target (at any delay D) last."""
    keys = [f"{d:g}" for d in wan["delays_ms"]]
    by = wan["by_delay"]
    cond = wan["conditions"]
    targets = wan["targets"]
    top = str(max(cond["concurrency"]))
    link = f", each capped at {wan['link_mbit']:g} Mbit/s" if wan.get("link_mbit") else ""
    lines = [f"wan: {cond['stages']} stages, every edge through the link emulator at D ms one-way{link}; "
             f"medians of {cond['rounds']} round{'s' if cond['rounds'] != 1 else ''}",
             f"{'measure':44} " + " ".join(f"{k + ' ms':>9}" for k in keys) + f"  {'target':<}"]

    def row(label: str, values: list[str], target: str = "") -> None:
        lines.append(f"{label:44} " + " ".join(f"{v:>9}" for v in values) + (f"  {target}" if target else ""))

    def each(get, fmt: str = ".2f") -> list[str]:
        return [format(get(by[k]), fmt) for k in keys]

    row("relay one-way delay, measured (ms)", each(lambda e: e["relay_one_way_ms"]), "D")
    row("plain decode ms/token", each(lambda e: e["plain_ms_per_token"]))
    row(f"floor ms/token ({cond['edges_per_token']} x D + plain at 0 ms)", each(lambda e: e["floor_ms_per_token"]))
    row("plain / floor", each(lambda e: e["ratios"]["plain_vs_floor"]), f"<={targets['plain_vs_floor_max']:g}")
    for name, label in (("repetitive", "repetitive"), ("free_form", "free-form")):
        row(f"speculative ngram, {label}: ms/token", each(lambda e, n=name: e["speculative_ms_per_token"][n]))
        row("  plain, the same prompt: ms/token", each(lambda e, n=name: e["plain_ms_per_token_same_prompts"][n]))
        row("  tokens/s, ngram over plain", each(lambda e, n=name: e["ratios"]["speculative_vs_plain_tokens_per_s"][n]),
            f">={targets['speculative_vs_plain_tokens_per_s_min'][name]:g}")
        row("  tokens kept per trip; ms per trip",
            [f"{e['speculative_tokens_per_trip'][name]:.1f};{e['speculative_ms_per_trip'][name]:.0f}"
             for e in (by[k] for k in keys)])
    for c in cond["concurrency"]:
        row(f"aggregate tok/s, {c} session{'s' if c != 1 else ''}",
            each(lambda e, c=str(c): e["aggregate_tokens_per_s"][c], ".1f"))
    row(f"aggregate {top} sessions vs zero delay", each(lambda e: e["ratios"]["aggregate_vs_zero_delay"][top]),
        f">={targets[f'aggregate_{top}_vs_zero_delay_min']:g}")
    row(f"TTFT ms, {cond['ttft_prompt_tokens']}-token prompt", each(lambda e: e["ttft_ms_1024"], ".0f"),
        f"<=TTFT at 0 + {targets['ttft_excess_trips_max']} x {cond['edges_per_token']} x D")
    row(f"  (TTFT - TTFT at 0) / ({cond['edges_per_token']} x D): trips paid", each(lambda e: e["ratios"]["ttft_excess_trips"], ".1f"),
        f"<={targets['ttft_excess_trips_max']}")
    row("outputs as at 0 ms (plain; speculative)",
        [f"{'yes' if e['outputs_match_zero_delay']['plain'] else 'NO'};"
         f"{'yes' if all(e['outputs_match_zero_delay']['speculative'].values()) else 'NO'}"
         for e in (by[k] for k in keys)])
    depth = cond.get("verify_window_depth")
    lines.append(f"  lanes {cond['lane_count']}, max_inflight {cond['max_inflight']}"
                 + (f", verify_window_depth {depth}" if depth is not None else "")
                 + f", n_batch {cond.get('n_batch', '?')}, hop transport "
                 f"{cond['hop_transport']}; {cond['decode_tokens']} plain tokens, {cond['speculative_tokens']} "
                 f"speculative (k auto), {cond['aggregate_tokens_per_session']} per concurrent session")
    return lines
