"""How a comparison is shown: the ranked table, the advice, the prediction; compare.json/.csv/.png."""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any

from ..scaling import BEYOND, CONTENTION, DDP_OVERHEAD, FORMULAS, HOST_FACTOR, THROUGHPUT
from ..tables import format_table
from .decide import depth_warning, half_never, unsure_warning
from .hostload import spread_warning
from .measure import Measurement
from .options import bandwidth_text
from .run import PROBE_LOAD_LIMIT, CompareResult

COLUMNS = ("strategy", "workers", "samples/s", "s to target", "data", "compute", "comm", "bubble",
           "bytes/sample", "loss/single", "loss/allreduce", "peak MB", "state MB/rank", "host load")


def ranked(result: CompareResult) -> list[Measurement]:
    """Measured strategies by the rule's speed (to the target loss, under the what-if link), fastest
    first, then the skipped and failed ones."""
    ok = sorted((m for m in result.measurements if m.ok), key=lambda m: (-_speed(m), -_rate(m)))
    return ok + [m for m in result.measurements if not m.ok]


def _speed(m: Measurement) -> float:
    return m.speed if m.speed == m.speed else -1.0


def _rate(m: Measurement) -> float:
    v = m.effective_samples_per_s
    return v if v == v else -1.0


def _times(v: float) -> str:
    return "-" if v != v else f"{v:.2f}x"


def _pct(v: float) -> str:
    return "-" if v != v else f"{v:.0%}"


def _spread(times: list[float]) -> float:
    """(largest - smallest) / median of the times that reached the target; NaN for fewer than two."""
    done = sorted(t for t in times if t == t)
    return (done[-1] - done[0]) / done[len(done) // 2] if len(done) >= 2 else math.nan


def table_rows(result: CompareResult) -> list[list[Any]]:
    rows: list[list[Any]] = []
    pick = result.recommendation.pick if result.recommendation else None
    for m in ranked(result):
        label = f"{m.label} *" if m.label == pick else m.label
        if not m.ok:
            continue  # listed under the table with the reason
        shares = m.shares()
        if m.simulated_comm_s > m.comm_s:  # the what-if link: its comm replaces the measured one
            step = m.data_s + m.compute_s + m.simulated_comm_s
            shares = {"data": m.data_s / step, "compute": m.compute_s / step, "comm": m.simulated_comm_s / step,
                      "bubble": m.bubble_s / step}
        rows.append([label, m.workers, float(round(m.effective_samples_per_s)), m.time_to_loss, _pct(shares["data"]),
                     _pct(shares["compute"]), _pct(shares["comm"]),
                     _pct(shares["bubble"]) if m.strategy == "pipeline" else "-",
                     float(round(m.bytes_per_sample)), _times(m.loss_vs_single),
                     _times(m.loss_ratio) if result.measurement("allreduce") else "-", m.peak_rss_mb,
                     m.state_mb, _pct(m.host_load)])
    return rows


def format_result(result: CompareResult) -> str:
    """Everything a person reads on the terminal, as one text."""
    lines = []
    what_if = []
    if result.straggler:
        what_if.append(f"straggler {result.straggler.text()}")
    if result.bandwidth:
        what_if.append(f"bandwidth {bandwidth_text(result.bandwidth)} (simulated from measured bytes)")
    head = (f"partrain compare: {result.workers} workers, batch {result.batch_size} per worker, model "
            f"{result.model_bytes / 2**20:.2f} MB; {result.elapsed_s:.0f} s of a {result.budget_s:.0f} s budget")
    lines.append(head + (f"; what if: {', '.join(what_if)}" if what_if else ""))
    if result.memory_note:
        lines.append(result.memory_note)
    lines.append("")
    lines.append(format_table(COLUMNS, table_rows(result)))
    for m in result.measurements:
        if not m.ok:
            lines.append(f"{m.label}: {m.status}: {m.reason}")
    target = result.target_loss
    ranked_by = (f"s to target: training seconds to test loss {target:.4g} (the median of the lowest of the "
                 "windows that learned), what the rank follows" if target == target else
                 "ranked by samples/s (the windows did not train far enough to time a target loss)")
    lines.append(f"{ranked_by}; data/compute/comm: shares of a worker's step; loss/X: test loss over X's at equal "
                 "samples (over the last half of the samples both trained); host load: the host's CPU time that "
                 "went elsewhere during the window (stolen by a hypervisor or used by other processes); * recommended")
    raced = [m for m in ranked(result) if m.ok and m.runoff]
    if raced:
        lines += ["", "run-off: the first round's leaders repeated their windows on new seeds, in alternating rounds; "
                  "each one's s to target is the median of its windows' (- never reached)"]
        lines.append(format_table(["strategy", "windows", "s to target, each", "median", "spread", "samples/s, each",
                                   "host load, each"], [
            [m.label, len(m.times_to_loss), ", ".join("-" if t != t else f"{t:.3g}" for t in m.times_to_loss),
             m.time_to_loss, _pct(_spread(m.times_to_loss)),
             ", ".join(f"{w.samples_per_s:,.0f}" for w in (m, *m.runoff)),
             ", ".join(_pct(w.host_load) for w in (m, *m.runoff))] for m in raced]))
        bounded = [m.label for m in raced if m.time_to_loss == m.time_to_loss and half_never(m.times_to_loss)]
        if bounded:
            lines.append(f"{', '.join(bounded)}: half the windows never reached the target; they count at their whole "
                         "length (they took at least that), so the median is a lower bound")
    rec = result.recommendation
    if rec is not None:
        lines += ["", f"recommended: {rec.pick} - {rec.why}"]
        for label, why in rec.others.items():
            if not why.startswith(("skipped", "failed")):  # those are listed under the table
                lines.append(f"  {label}: {why}")
    for warning in (unsure_warning(rec), depth_warning(result.measurements, rec, result.target_loss),
                    spread_warning(result.measurements)):
        if warning:
            lines.append(f"caution: {warning}")
    checked = len(result.host_factors) > 1  # h: the probe's checked by local-update windows
    if result.constants is not None:
        c = result.constants
        link = (f"B = {result.link[0] / 1e6:,.0f} MB/s, a = {result.link[1] * 1e6:.0f} us" if result.link
                else "no link probed")
        lines += ["", "predicted scaling (constants from the single window and the host probe"
                  f"{', h with the local-update windows' if checked else ''}: t1 = "
                  f"{c.step_s * 1e3:.2f} ms per step of b = {c.batch}, S = {c.model_bytes / 2**20:.2f} MB in "
                  f"k = {c.messages} bucket(s); here h = {c.host_factor:.2f}, o = {c.overhead_s * 1e3:.2f} ms, "
                  f"c = {c.contention_s * 1e3:.2f} ms, {link})", f"  {HOST_FACTOR}", f"  {DDP_OVERHEAD}",
                  f"  {CONTENTION}"]
        if checked:
            probe, *windows = result.host_factors.items()
            lines.append(f"  h here: the median of the host probe's {probe[1]:.2f} and the local-update windows' "
                         + ", ".join(f"{h:.2f} ({label})" for label, h in windows)
                         + ": each window trains its workers at once for seconds, averaging every H steps (h solved "
                         "from its samples/s with the link and c as probed), where the probe's parts run for under a "
                         "second, and a host busy elsewhere for that second misreads it")
        loaded = probe_warning(result)
        if loaded:
            lines.append(f"  caution: {loaded}")
        for name in ("allreduce", "ps", "localsgd"):
            lines.append(f"  {name}: {FORMULAS[name]}")
        lines += [f"  {THROUGHPUT}", f"  {BEYOND}"]
        workers = sorted({p.workers for p in result.predictions})
        headers = ["strategy", "link"] + [f"{w} workers" for w in workers]
        rows = []
        for key in dict.fromkeys((p.strategy, p.bandwidth) for p in result.predictions):
            cells = {p.workers: p for p in result.predictions if (p.strategy, p.bandwidth) == key}
            rows.append([key[0], bandwidth_text(key[1])] +
                        [f"{cells[w].samples_per_s:,.0f}/s ({cells[w].efficiency:.0%})" for w in workers])
        if rows:
            lines.append(format_table(headers, rows))
    v = result.validation
    if v:
        lines += ["", f"check of the model here: {int(v['workers'])}-worker allreduce predicted from one worker "
                  f"and the host probe{' (h: with the local-update windows)' if checked else ''}"
                  f" {v['predicted']:,.0f} samples/s, measured {v['measured']:,.0f} "
                  f"(error {v['error']:.0%})"]
    elif result.straggler is not None and result.constants is not None:
        lines += ["", f"check of the model here: not made: the injected straggler (worker {result.straggler.worker}, "
                  f"{result.straggler.slowdown:g}x) slows every step of the measured allreduce, and the model "
                  "predicts workers of equal speed"]
    return "\n".join(lines)


def probe_warning(result: CompareResult) -> str | None:
    """One line when the host probe kept (`partrain.compare.run.probe_quietly`) still shared the host
    with other work, else None."""
    if not result.probe_load > PROBE_LOAD_LIMIT:
        return None
    return (f"{result.probe_load:.0%} of the host's CPU went elsewhere during the host probe"
            f"{' (and during its repeat)' if result.probes > 1 else ''}: h, o and c, and the predictions, "
            "may be the load's doing; run compare again on a quieter machine")


def to_json(result: CompareResult) -> dict[str, Any]:
    def clean(v: Any) -> Any:
        if isinstance(v, float):
            return None if not math.isfinite(v) else v
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    rec = result.recommendation
    return clean({
        "budget_s": result.budget_s, "elapsed_s": result.elapsed_s, "workers": result.workers,
        "target_loss": result.target_loss,
        "batch_size": result.batch_size, "model_bytes": result.model_bytes,
        "straggler": result.straggler.text() if result.straggler else None,
        "bandwidth": result.bandwidth,
        "link": {"bandwidth": result.link[0], "latency_s": result.link[1]} if result.link else None,
        "recommendation": {"pick": rec.pick, "why": rec.why, "others": rec.others, "tied": rec.tied,
                           "noise": rec.noise} if rec else None,
        "strategies": [_measurement_json(m) for m in ranked(result)],
        "constants": vars(result.constants) if result.constants else None,
        "formulas": {**FORMULAS, "throughput": THROUGHPUT, "h": HOST_FACTOR, "o": DDP_OVERHEAD,
                     "c": CONTENTION, "beyond": BEYOND},
        "host_factors": result.host_factors, "buckets": result.buckets, "probe": result.probe,
        "probe_load": result.probe_load, "probes": result.probes,
        "predictions": [vars(p) for p in result.predictions],
        "validation": result.validation or None,
        "host_load_warning": spread_warning(result.measurements),
        "unsure_warning": unsure_warning(rec),
        "depth_warning": depth_warning(result.measurements, rec, result.target_loss),
        "probe_warning": probe_warning(result),
        "memory_note": result.memory_note or None,
    })


def _measurement_json(m: Measurement) -> dict[str, Any]:
    out = {k: getattr(m, k) for k in ("label", "strategy", "workers", "status", "reason", "processes", "steps",
                                      "samples", "window_s", "wall_s", "samples_per_s", "effective_samples_per_s",
                                      "data_s", "compute_s", "comm_s", "bubble_s", "simulated_comm_s",
                                      "bytes_per_step", "bytes_per_sample", "loss_ratio", "loss_vs_single",
                                      "time_to_loss", "speed", "peak_rss_mb", "state_mb", "host_steal", "host_other")}
    out["options"] = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in m.options.items()}
    out["curve"] = [list(p) for p in m.curve]
    out["curve_s"] = list(m.curve_s)
    # each window's time to the target: the first, then the run-off's repeats (their figures below)
    out["times_to_loss"] = list(m.times_to_loss)
    out["runoff"] = [{k: v for k, v in _measurement_json(w).items()
                      if k not in ("label", "strategy", "options", "runoff", "times_to_loss", "time_to_loss", "speed")}
                     for w in m.runoff]
    return out


CSV_FIELDS = ("label", "strategy", "workers", "status", "reason", "steps", "samples", "samples_per_s",
              "effective_samples_per_s", "data_s", "compute_s", "comm_s", "bubble_s", "simulated_comm_s",
              "bytes_per_sample", "loss_ratio", "loss_vs_single", "peak_rss_mb", "state_mb", "time_to_loss",
              "speed", "host_steal", "host_other", "times_to_loss")


def write_outputs(result: CompareResult, out_dir: str) -> dict[str, str]:
    """``compare.json``, ``compare.csv`` and ``compare.png`` in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"compare.{k}") for k in ("json", "csv", "png")}
    target = result.target_loss
    with open(paths["json"] + ".tmp", "w") as f:
        json.dump(to_json(result), f, indent=2, allow_nan=False)
    os.replace(paths["json"] + ".tmp", paths["json"])
    with open(paths["csv"] + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for m in ranked(result):
            w.writerow({k: getattr(m, k) for k in CSV_FIELDS[:-1]} |
                       {"times_to_loss": ";".join(f"{t:.6g}" for t in m.times_to_loss)})
    os.replace(paths["csv"] + ".tmp", paths["csv"])
    plot(result, paths["png"], target)
    return paths


def plot(result: CompareResult, path: str, target: float) -> None:
    """Three panels: samples/s per strategy, seconds to a common loss, predicted scaling curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [m for m in ranked(result) if m.ok]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [m.label for m in ok]
    pick = result.recommendation.pick if result.recommendation else None
    colors = ["tab:green" if m.label == pick else "tab:blue" for m in ok]
    axes[0].barh(labels, [m.effective_samples_per_s for m in ok], color=colors)
    axes[0].set(title="samples/s (recommended in green)", xlabel="samples/s")
    axes[0].invert_yaxis()
    times = [m.time_to_loss for m in ok]
    axes[1].barh(labels, [t if t == t else 0 for t in times], color=colors)
    # the run-off's repeats: every window's own time, a dot on its strategy's bar of their median
    dots = [(t, i) for i, m in enumerate(ok) if m.runoff for t in m.times_to_loss if t == t]
    if dots:
        axes[1].scatter([t for t, _ in dots], [i for _, i in dots], color="black", s=12, zorder=3,
                        label="each window (run-off)")
        axes[1].legend(fontsize=7)
    axes[1].set(title=f"seconds to test loss {target:.3g}", xlabel="seconds of training")
    axes[1].invert_yaxis()
    for key in dict.fromkeys((p.strategy, p.bandwidth) for p in result.predictions):
        pts = sorted((p.workers, p.efficiency) for p in result.predictions if (p.strategy, p.bandwidth) == key)
        axes[2].plot([w for w, _ in pts], [e for _, e in pts], marker="o",
                     label=f"{key[0]}, {bandwidth_text(key[1])}")
    axes[2].set(title="predicted scaling efficiency", xlabel="workers", ylabel="efficiency", xscale="log",
                ylim=(0, 1.05))
    if result.predictions:
        axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=90)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
