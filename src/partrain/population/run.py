"""What ``partrain population`` does, as a function of its validated config (see `cli`).

One process, or ``workers`` processes started by ``partrain.launch``, each owning
a slice of the members. Process 0 writes every output file; population
checkpoints are one file per process (``population.pt``, ``population.rank1.pt``...).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

from ..checkpoint import save_checkpoint
from ..data.datasets import preprocessing
from ..models import build_model
from .pbt import PBT
from .population import Population
from .prepare import Prepared, checkpoint_path, prepare, split_validation
from .report import format_leaderboard, plot_curves, write_csv, write_jsonl
from .space import parse_space_entry, sample
from .trainer import MemberLoader, train_population

__all__ = ["initial_hparams", "leaderboard_rows", "ranking", "run_population", "split_validation"]


def run_population(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the population ``cfg`` describes; write the outputs; return a summary.

    Every check the parent can make runs first (`prepare`), so bad input is one line
    before any process starts; the workers get the data as tensors.
    """
    prepared = prepare(cfg)
    if cfg["workers"] > 1:
        from ..launch import launch

        return launch(_worker, cfg, prepared, workers=cfg["workers"], timeout=cfg["timeout"])[0]
    return _body(cfg, prepared, distributed=False, device=None)


def _worker(strategy: Any, cfg: dict[str, Any], prepared: Prepared) -> dict[str, Any] | None:
    return _body(cfg, prepared, distributed=True, device=strategy.device)


def initial_hparams(space: dict[str, Any], members: int, seed: int) -> list[dict[str, float]]:
    """Each member's starting hyperparameters, drawn from the space (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return [{k: sample(spec, gen) for k, spec in space.items()} for _ in range(members)]


def _body(cfg: dict[str, Any], prepared: Prepared, distributed: bool,
          device: torch.device | None) -> dict[str, Any] | None:
    seed = cfg["seed"]
    train, val, test = prepared.train, prepared.val, prepared.test
    shape, classes, kwargs = prepared.shape, prepared.classes, prepared.model_kwargs
    steps, eval_interval = prepared.steps, prepared.eval_interval
    model_fn = functools.partial(build_model, cfg["model"], **kwargs)
    space = dict(parse_space_entry(e) for e in cfg["space_args"])
    hparams = initial_hparams(space, cfg["members"], seed)
    if "batch_size" in space:
        for h in hparams:
            h["batch_size"] = float(min(max(1, round(h["batch_size"])), len(train)))
    pop = Population(model_fn, cfg["members"], cfg["optimizer"], hparams, engine=cfg["engine"], seed=seed,
                     nesterov=cfg["nesterov"], device=device, distributed=distributed)
    pbt = None
    if cfg["pbt_interval"]:
        pbt = PBT(space, interval=cfg["pbt_interval"], quantile_fraction=cfg["quantile_fraction"],
                  perturbation_factors=cfg["perturbation_factors"],
                  resample_probability=cfg["resample_probability"], metric=cfg["metric"],
                  mode="max" if cfg["metric"] == "accuracy" else "min", seed=seed)
    loader = MemberLoader(train, pop.members, seed, pop.device)
    history: list[dict[str, Any]] = []
    main = pop.rank == 0
    path = checkpoint_path(cfg["out"], pop.rank)
    if cfg["resume"]:
        state = torch.load(path, map_location="cpu", weights_only=True)
        pop.load_state_dict(state["population"])
        loader.load_state_dict(state["loader"])
        if pbt is not None and state.get("pbt"):
            pbt.load_state_dict(state["pbt"])
        history = list(state["history"])

    def checkpoint(step: int, records: list[dict[str, Any]]) -> None:
        _save({"population": pop.state_dict(), "loader": loader.state_dict(),
               "pbt": pbt.state_dict() if pbt is not None else None, "history": history,
               "config": _plain(cfg)}, path)

    train_population(pop, train, val, steps=steps, batch_size=cfg["batch_size"], pbt=pbt,
                     eval_interval=eval_interval, seed=seed, loader=loader, history=history,
                     on_eval=checkpoint)

    # final scores: validation picks the best member, the test set reports it
    tx, ty = test.tensors
    ev_val = pop.evaluate(val.tensors[0], val.tensors[1])
    ev_test = pop.evaluate(tx, ty)
    val_acc, val_loss = pop.gather(ev_val["accuracy"]), pop.gather(ev_val["loss"])
    test_acc, test_loss = pop.gather(ev_test["accuracy"]), pop.gather(ev_test["loss"])
    order = ranking(val_acc, val_loss, cfg["metric"])
    best = order[0]
    tensors = pop.member_tensors(best, to_rank=0)
    if not main:
        return None

    lineage = pbt.lineage if pbt is not None else []
    rows = leaderboard_rows(pop, order, val_acc, val_loss, test_acc, test_loss, lineage)
    write_csv(os.path.join(cfg["out"], "leaderboard.csv"), rows)
    write_csv(os.path.join(cfg["out"], "history.csv"), history)
    write_jsonl(os.path.join(cfg["out"], "lineage.jsonl"), lineage)
    plot_curves(history, lineage, os.path.join(cfg["out"], "curves.png"))

    model_state, opt_state = pop.member_state(best, tensors)
    member_hp = pop.member_hparams(best)
    batch = int(member_hp.get("batch_size") or cfg["batch_size"])
    save_checkpoint(os.path.join(cfg["out"], "best.pt"), {
        "model": model_state,
        "model_spec": {"name": cfg["model"], "kwargs": kwargs, "input_shape": shape, "num_classes": classes,
                       "task": "classification",
                       **({"preprocess": pre} if (pre := preprocessing(cfg["dataset"])) else {})},
        "optimizer": opt_state,
        "strategy": None,
        "scheduler": None,
        "epoch": int(pop.steps * batch // len(train)),
        "step": pop.steps,
        "config": {**_plain(cfg), "member": best, "hparams": member_hp, "optimizer": cfg["optimizer"],
                   "lr": member_hp["lr"], "batch_size": batch, "source": "partrain population"},
        "metrics": [],
    })
    report = pop.engine_report
    if report.get("chosen"):
        engine_line = (f"auto chose {report['chosen']} (vmap {report['vmap_step_s'] * 1e3:.1f} ms/step, "
                       f"loop {report['loop_step_s'] * 1e3:.1f} ms/step over {report['measured_steps']} steps)")
    else:
        engine_line = pop.engine
    return {"best": best, "best_test_accuracy": float(test_acc[best]), "leaderboard": rows,
            "best_epoch": int(pop.steps * batch // len(train)),
            "leaderboard_text": format_leaderboard(rows), "engine": pop.engine, "engine_report": report,
            "engine_line": engine_line, "steps": pop.steps, "lineage": len(lineage)}


def ranking(val_acc: torch.Tensor, val_loss: torch.Tensor, metric: str) -> list[int]:
    """Member ids best first by the validation ``metric`` (the other breaks ties; NaN ranks last)."""
    def key(m: int) -> tuple[float, float, int]:
        acc, loss = float(val_acc[m]), float(val_loss[m])
        acc = -acc if acc == acc else math.inf
        loss = loss if loss == loss else math.inf
        return (acc, loss, m) if metric == "accuracy" else (loss, acc, m)

    return sorted(range(len(val_acc)), key=key)


def leaderboard_rows(pop: Population, order: list[int], val_acc: torch.Tensor, val_loss: torch.Tensor,
                     test_acc: torch.Tensor, test_loss: torch.Tensor,
                     lineage: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per member in ``order`` (best first): scores, hyperparameters, PBT copies."""
    rows = []
    for place, m in enumerate(order, 1):
        copies = [r for r in lineage if r["dst"] == m]
        rows.append({"rank": place, "member": m, "val_accuracy": round(float(val_acc[m]), 4),
                     "val_loss": round(float(val_loss[m]), 4), "test_accuracy": round(float(test_acc[m]), 4),
                     "test_loss": round(float(test_loss[m]), 4), **pop.member_hparams(m),
                     "exploits": len(copies), "last_copied_from": copies[-1]["src"] if copies else ""})
    return rows


def _plain(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}


def _save(state: dict[str, Any], path: str) -> None:
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
