"""What a load test saw, and how it is shown: `LoadReport` (figures for ``--json``, lines for the terminal)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def percentile_ms(seconds: Sequence[float], q: float) -> float:
    """The ``q`` percentile of durations in seconds, in milliseconds (nan when there are none)."""
    if len(seconds) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(seconds), q) * 1e3)


@dataclass
class LoadReport:
    """What one load test saw: one outcome per request sent (a latency or an error kind)."""

    mode: str  # "closed loop, concurrency 16" / "open loop, poisson 200/s"
    elapsed: float
    sent: int
    latencies: list[float]  # seconds, answered requests only
    errors: Counter  # kind -> count: "HTTP 503", "timeout", "connection error", ...
    duplicates: int = 0  # requests that recorded more than one outcome (must be 0)
    missing: int = 0  # requests with no outcome at all (must be 0)
    id_mismatches: int = 0  # answers that echoed another request's id
    checked: int = 0  # answers compared with the local model
    wrong: int = 0  # answers that differ from the local model beyond atol/rtol
    first_wrong: str = ""  # a description of the first wrong answer
    first_error: str = ""  # the first failed request: its kind and what the server said

    @classmethod
    def merge(cls, reports: list[LoadReport]) -> LoadReport:
        """One report of load tests that ran side by side (one per client process).

        Counts add up, latencies are pooled (percentiles over every answer), the
        elapsed time is the longest run's (so throughput is answers over the wall
        time they all took), first errors and wrong answers are the first found.
        """
        if not reports:
            raise ValueError("Expected at least one report to merge. Received: none")
        if len(reports) == 1:
            return reports[0]
        mode = reports[0].mode
        if mode.startswith("closed loop, concurrency "):
            mode = (f"closed loop, concurrency {sum(int(r.mode.rsplit(' ', 1)[1]) for r in reports)} "
                    f"over {len(reports)} processes")
        else:
            mode = f"{mode} in each of {len(reports)} processes"
        errors: Counter = Counter()
        for r in reports:
            errors.update(r.errors)
        return cls(mode=mode, elapsed=max(r.elapsed for r in reports), sent=sum(r.sent for r in reports),
                   latencies=[x for r in reports for x in r.latencies], errors=errors,
                   duplicates=sum(r.duplicates for r in reports), missing=sum(r.missing for r in reports),
                   id_mismatches=sum(r.id_mismatches for r in reports), checked=sum(r.checked for r in reports),
                   wrong=sum(r.wrong for r in reports),
                   first_wrong=next((r.first_wrong for r in reports if r.first_wrong), ""),
                   first_error=next((r.first_error for r in reports if r.first_error), ""))

    @property
    def ok(self) -> int:
        return len(self.latencies)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    @property
    def error_rate(self) -> float:
        """Failed requests / requests sent (1 when nothing was sent: nothing worked)."""
        return self.failed / self.sent if self.sent else 1.0

    def failures(self, max_error_rate: float = 0.0) -> list[str]:
        """One line per reason this run failed (empty when it passed): errors, lost or wrong answers."""
        lines = []
        if self.sent == 0:
            lines.append("no request was sent")
        elif self.error_rate > max_error_rate:
            lines.append(f"{self.failed} of {self.sent} requests failed (error rate {self.error_rate:.3g} > "
                         f"--max-error-rate {max_error_rate:g}); first: {self.first_error}")
        if self.lost:
            lines.append(f"{self.lost} of {self.sent} requests did not get exactly one answer of their own "
                         f"(missing {self.missing}, duplicated {self.duplicates}, "
                         f"wrong id {self.id_mismatches})")
        if self.wrong:
            lines.append(f"{self.wrong} of {self.checked} answers checked were wrong; first: {self.first_wrong}")
        return lines

    @property
    def throughput(self) -> float:
        return self.ok / self.elapsed if self.elapsed > 0 else float("nan")

    def percentile(self, q: float) -> float:
        """Latency percentile in milliseconds (nan when nothing was answered)."""
        return percentile_ms(self.latencies, q)

    @property
    def lost(self) -> int:
        """Requests without exactly one answer of their own."""
        return self.missing + self.duplicates + self.id_mismatches

    def figures(self) -> dict[str, float]:
        """Every figure as a flat dict (``--json``); errors as ``errors.<kind>``."""
        out: dict[str, float] = {
            "sent": self.sent, "ok": self.ok, "failed": self.failed, "error_rate": self.error_rate,
            "elapsed_s": self.elapsed,
            "throughput_rps": self.throughput, "p50_ms": self.percentile(50),
            "p90_ms": self.percentile(90), "p99_ms": self.percentile(99),
            "mean_ms": float(np.mean(self.latencies) * 1e3) if self.latencies else float("nan"),
            "lost": self.lost, "duplicates": self.duplicates, "missing": self.missing,
            "id_mismatches": self.id_mismatches, "checked": self.checked, "wrong": self.wrong,
        }
        for kind, n in sorted(self.errors.items()):
            out[f"errors.{kind}"] = n
        return out

    def _errors_line(self) -> str:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"
        if self.first_error:
            errors += f" (first: {self.first_error})"
        return f"  errors    {errors}"

    def _one_each_line(self) -> str:
        # "yes" would be vacuous when no request got an answer to count
        one_each = (f"no answers to check, 0 of {self.sent} answered" if self.ok == 0
                    else "yes" if self.lost == 0 else "NO")
        return (f"  exactly one answer each: {one_each} "
                f"(missing {self.missing}, duplicated {self.duplicates}, wrong id {self.id_mismatches})")

    def format(self) -> str:
        """A few readable lines for the terminal."""
        lines = [
            f"{self.mode}: {self.sent} requests in {self.elapsed:.2f} s",
            f"  answered  {self.ok} of {self.sent}  ({self.throughput:,.1f} requests/s)",
            f"  latency   p50 {self.percentile(50):.2f} ms  p90 {self.percentile(90):.2f} ms  "
            f"p99 {self.percentile(99):.2f} ms",
            self._errors_line(),
            self._one_each_line(),
        ]
        if self.checked:
            verdict = "all right" if self.wrong == 0 else f"{self.wrong} WRONG ({self.first_wrong})"
            lines.append(f"  answers checked against the local model: {self.checked}, {verdict}")
        else:
            lines.append("  answers not checked (no --check model)")
        return "\n".join(lines)


@dataclass
class GenerateReport(LoadReport):
    """What a generate load test saw: `LoadReport`'s counts (``latencies`` end to end) and per token.

    ``ttft``: seconds from a request's send (open loop: its scheduled arrival) to the
    first event carrying a token; ``tpot``: seconds per output token after the first,
    per request with two tokens or more. ``checked``/``wrong`` count greedy answers
    compared with the local model; ``ties`` those that differ from it only where its
    two best logits are within the tie tolerance (float rounding, not a wrong answer).
    """

    workload: str = ""  # prompts, lengths and sampling, one line
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # summed over the answers (their usage)
    output_tokens: int = 0  # tokens streamed in the answers
    miscounted: int = 0  # answers with another number of tokens than asked, or than their usage says
    first_miscounted: str = ""
    ties: int = 0
    first_tie: str = ""
    repeats_differ: int = 0  # seeded (sampled) answers unlike the first answer to the same prompt and seed
    unchecked: str = ""  # why answers were not checked against the local model, when they were not

    @property
    def token_throughput(self) -> float:
        """Output tokens per second of the whole run."""
        return self.output_tokens / self.elapsed if self.elapsed > 0 else float("nan")

    def failures(self, max_error_rate: float = 0.0) -> list[str]:
        lines = super().failures(max_error_rate)
        if self.miscounted:
            lines.append(f"{self.miscounted} of {self.ok} answers did not have the tokens asked for; "
                         f"first: {self.first_miscounted}")
        return lines

    def figures(self) -> dict[str, float]:
        """`LoadReport.figures` (``p50_ms``...: end to end) and the token figures."""
        out = super().figures()
        out.update({
            "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
            "output_tokens_per_s": self.token_throughput,
            "miscounted": self.miscounted, "ties": self.ties, "repeats_differ": self.repeats_differ,
        })
        for name, values in (("ttft", self.ttft), ("tpot", self.tpot)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_ms"] = percentile_ms(values, q)
        return out

    def format(self) -> str:
        def spread(values: Sequence[float], qs: tuple[int, ...] = (50, 90, 99)) -> str:
            return "  ".join(f"p{q} {percentile_ms(values, q):.2f} ms" for q in qs)

        lines = [
            f"{self.mode}: {self.sent} requests in {self.elapsed:.2f} s",
            *([f"  sending   {self.workload}"] if self.workload else []),
            f"  answered  {self.ok} of {self.sent}  ({self.throughput:,.2f} requests/s, "
            f"{self.token_throughput:,.1f} output tokens/s; {self.output_tokens} tokens out, "
            f"{self.prompt_tokens} in)",
            f"  TTFT      {spread(self.ttft)}  (time to first token)",
            f"  TPOT      {spread(self.tpot)}  (time per output token after the first)",
            f"  latency   {spread(self.latencies, (50, 99))}  (end to end)",
            self._errors_line(),
            self._one_each_line(),
        ]
        if self.ok:
            counted = "yes" if not self.miscounted else f"NO, {self.miscounted} ({self.first_miscounted})"
            lines.append(f"  tokens as asked: {counted}")
        if self.repeats_differ:
            lines.append(f"  seeded repeats of a prompt that differ from its first answer: {self.repeats_differ}")
        if self.checked:
            verdict = "all right" if self.wrong == 0 else f"{self.wrong} WRONG ({self.first_wrong})"
            if self.ties:
                verdict += f"; {self.ties} differ only at near-ties of the logits ({self.first_tie})"
            lines.append(f"  greedy answers checked against the local model: {self.checked}, {verdict}")
        else:
            lines.append(f"  answers not checked ({self.unchecked or 'no --check model'})")
        return "\n".join(lines)
