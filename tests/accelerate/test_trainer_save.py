"""``Trainer.save_model`` under the plugin warns where it would write no model weights."""

from __future__ import annotations

import types
import warnings

import pytest

from accelerate_plugin import VeScaleFSDPPlugin


def test_trainer_save_model_warns_where_it_would_write_nothing(monkeypatch):
    transformers_trainer = pytest.importorskip("transformers.trainer")
    from accelerate_plugin import trainer_save

    calls = []
    monkeypatch.setattr(
        transformers_trainer.Trainer,
        "save_model",
        lambda self, output_dir=None, _internal_call=False: calls.append(_internal_call),
    )
    trainer_save.install()
    save_model = transformers_trainer.Trainer.save_model

    def fake_trainer(state_dict_type):
        plugin = VeScaleFSDPPlugin(state_dict_type=state_dict_type)
        return types.SimpleNamespace(accelerator=types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)))

    with pytest.warns(UserWarning, match="writes no model weights with fsdp_state_dict_type SHARDED_STATE_DICT"):
        save_model(fake_trainer("SHARDED_STATE_DICT"), "out")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_model(fake_trainer("FULL_STATE_DICT"), "out")
        save_model(fake_trainer("SHARDED_STATE_DICT"), "out", _internal_call=True)  # the Trainer's own checkpoints
    assert calls == [False, False, True]
