"""The AttendOut task's training step enters autocast through ``torch.autocast``: the
deprecated ``torch.cuda.amp.autocast(args...)`` warned at every start (issue 26). Apart from
tests/test_attendout.py, which others edit; its tiny data and builders are reused."""

import warnings

from tests.test_attendout import Optimizer, build, data, make_sample  # noqa: F401 (fixture)


def test_train_step_uses_no_deprecated_autocast(data):  # noqa: F811
    task, model, criterion, cfg = build(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pytest.ini ignores this warning elsewhere
        _, sample_size, _ = task.train_step(make_sample(task), model, criterion,
                                            Optimizer(cfg, model), 0)
    assert sample_size > 0
    deprecated = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                  if "autocast" in str(w.message) or "torch.cuda.amp" in str(w.message)]
    assert not deprecated, deprecated
