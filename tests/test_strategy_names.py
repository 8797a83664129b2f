"""Misspelt strategy names are answered with the nearest tiered name and the list of them."""

import lightning as L
import pytest

import offload_strategy
from offload_strategy import UnknownStrategyNameError
from offload_strategy.lightning.names import suggestion


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("tierd", "tiered"), ("tiered_zero-offload", "tiered_zero_offload"), ("Tiered-LoHan", "tiered_lohan"), ("tiered_ddpp", "tiered_ddp")],
)
def test_trainer_answers_a_near_miss_with_did_you_mean(typed, meant):
    with pytest.raises(UnknownStrategyNameError, match=f"did you mean '{meant}'") as caught:
        L.Trainer(strategy=typed, accelerator="cpu", devices=1, logger=False)
    message = str(caught.value)
    assert "tiered_zero_offload" in message and "tiered_protrain" in message and "tiered_ddp" in message
    assert repr(typed.lower()) in message


def test_fabric_answers_a_near_miss_too():
    with pytest.raises(UnknownStrategyNameError, match="did you mean 'tiered'"):
        L.Fabric(strategy="tierd", accelerator="cpu", devices=1)


def test_other_unknown_names_keep_lightnings_error():
    with pytest.raises(ValueError, match="invalid strategy name") as caught:
        L.Trainer(strategy="ddp_spwan_typo", accelerator="cpu", devices=1, logger=False)
    assert not isinstance(caught.value, UnknownStrategyNameError)


def test_registered_names_still_build_and_reregistering_wraps_once():
    offload_strategy._register_strategies()
    offload_strategy._register_strategies()
    trainer = L.Trainer(strategy="tiered_lohan", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy).__name__ == "TieredStrategy"
    assert suggestion("ddp", ["ddp", "tiered"]) is None
