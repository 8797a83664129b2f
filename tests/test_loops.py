"""validate, test and predict run with offloaded parameters, on their own and after fit."""

from __future__ import annotations

import lightning as L
import torch

from offload_strategy.demos import CausalLM
from offload_strategy import TieredStrategy
from tests.helpers import PARAMETERS_ONLY, tiny_data, train
from tests.test_offload import GPT2_4L, beside_kept, param_bytes


class Evaluated(CausalLM):
    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test/loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch).logits[:, -1]


def make() -> Evaluated:
    return Evaluated(family="gpt2", config=GPT2_4L, lr=1e-2)


class SawEngine(L.Callback):
    def __init__(self) -> None:
        self.requests = 0.0

    def _count(self, trainer) -> None:
        engine = trainer.strategy.engine
        assert engine is not None, "nothing was offloaded"
        self.requests += engine.ctx.requests.report()["requests"]

    def on_validation_batch_end(self, trainer, *args):
        self._count(trainer)

    def on_test_batch_end(self, trainer, *args):
        self._count(trainer)

    def on_predict_batch_end(self, trainer, *args):
        self._count(trainer)


def run_loops(strategy, tmp_path, callbacks=()):
    L.seed_everything(0, verbose=False)
    model = make()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks))
    data = tiny_data()
    validated = trainer.validate(model, datamodule=data, verbose=False)[0]["val/loss"]
    data.setup("fit")
    tested = trainer.test(model, dataloaders=data.val_dataloader(), verbose=False)[0]["test/loss"]
    predicted = torch.cat(trainer.predict(model, dataloaders=data.val_dataloader()))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return validated, tested, predicted, weights


def test_validate_test_predict_on_their_own(tmp_path):
    total = param_bytes(make)
    expected = run_loops("auto", tmp_path / "plain")
    saw = SawEngine()
    got = run_loops(TieredStrategy(gpu_memory=int(0.3 * total), host_memory="1GiB"), tmp_path / "tiered", callbacks=(saw,))  # the default policy
    assert saw.requests > 0
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2])
    for name in expected[3]:  # evaluation left every parameter as it was, real and in place
        assert torch.equal(got[3][name], expected[3][name]), name


def test_evaluation_after_fit_matches(tmp_path):
    total = param_bytes(make)
    _, _, plain = train("auto", tmp_path / "plain", epochs=1, make_model=make)
    # 0.3 of the parameters beside the kept layout's peak (the same 4-layer GPT-2 as test_offload's)
    _, _, tiered = train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory="1GiB"), tmp_path / "tiered", epochs=1, make_model=make)
    data = tiny_data()
    assert tiered.validate(tiered.lightning_module, datamodule=data, verbose=False) == plain.validate(plain.lightning_module, datamodule=data, verbose=False)
