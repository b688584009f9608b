"""The names the docs use are importable where the docs say."""

import partrain
from partrain.strategies import (
    AllReduce,
    Hogwild,
    LocalSGD,
    ParameterServer,
    Single,
    available,
    get_strategy,
)


def test_strategy_classes_are_importable_from_partrain_strategies():
    classes = (AllReduce, Hogwild, LocalSGD, ParameterServer, Single)
    assert sorted(cls.name for cls in classes) == sorted(set(available()) & {c.name for c in classes})
    for cls in classes:
        assert type(get_strategy(cls.name)) is cls


def test_fit_pieces_are_importable_from_partrain():
    from partrain.train.task import Task

    assert partrain.fit.__module__ == "partrain.train.fit"
    assert partrain.FitConfig().on_nan == "stop" and Task("mse").loss_name == "mse"
