"""The output files of a population run: leaderboard and history tables, lineage, the curves PNG."""

from __future__ import annotations

import csv
import json
import math
from typing import Any

from ..tables import format_table


def format_leaderboard(rows: list[dict[str, Any]], limit: int = 20) -> str:
    """The leaderboard as a plain-text table (best first, at most ``limit`` rows).

    A member whose loss is NaN or infinite (it diverged) shows ``nan`` or ``inf``,
    not the table's "-" for a missing value.
    """
    if not rows:
        return "(no members)"
    headers = list(rows[0])
    body = []
    for r in rows[:limit]:
        body.append([_cell(k, v) for k, v in r.items()])
    text = format_table(headers, body)
    if len(rows) > limit:
        text += f"\n... {len(rows) - limit} more in leaderboard.csv"
    return text


def _cell(key: str, value: Any) -> Any:
    if not isinstance(value, float):
        return value
    if not math.isfinite(value):
        return str(value)  # nan, inf, -inf: a diverged member says so
    return value if key in ("val_accuracy", "test_accuracy", "val_loss", "test_loss") else f"{value:.4g}"


def plot_curves(history: list[dict[str, Any]], lineage: list[dict[str, Any]], path: str) -> None:
    """Per-member validation accuracy and training loss against steps; PBT copies marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    members = sorted({r["member"] for r in history})
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = plt.get_cmap("viridis", max(2, len(members)))
    for i, m in enumerate(members):
        recs = [r for r in history if r["member"] == m]
        steps = [r["step"] for r in recs]
        ax_acc.plot(steps, [r["val_accuracy"] for r in recs], color=cmap(i), lw=1, label=f"member {m}")
        ax_loss.plot(steps, [r["train_loss"] for r in recs], color=cmap(i), lw=1)
    for rec in lineage:
        ax_acc.axvline(rec["step"], color="0.85", lw=0.5, zorder=0)
    ax_acc.set(xlabel="step", ylabel="validation accuracy", title="validation accuracy per member")
    ax_loss.set(xlabel="step", ylabel="training loss", title="training loss per member", yscale="log")
    if len(members) <= 12:
        ax_acc.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    """``rows`` as a CSV file with a header (the keys of the first row); nothing for no rows."""
    if not rows:
        return
    keys = list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    """One JSON object per line."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
