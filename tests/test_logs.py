"""The runtime's processes log their protocol timeline when CHRONOSTREAM_LOG asks for it."""

from __future__ import annotations

import logging

import pytest

from chronostream.containers.logs import ENV, configure_from_env


@pytest.fixture
def chronostream_logger():
    root = logging.getLogger("chronostream")
    level, handlers = root.level, list(root.handlers)
    yield root
    root.setLevel(level)
    root.handlers[:] = handlers


def test_without_the_variable_logging_is_left_alone(monkeypatch, chronostream_logger):
    monkeypatch.delenv(ENV, raising=False)
    before = (chronostream_logger.level, list(chronostream_logger.handlers))
    assert configure_from_env() is None
    assert (chronostream_logger.level, chronostream_logger.handlers) == before


def test_the_variable_sets_the_level_with_one_handler_however_often_called(monkeypatch, chronostream_logger):
    monkeypatch.setenv(ENV, "info")
    assert configure_from_env() == "INFO"
    assert configure_from_env() == "INFO"
    assert chronostream_logger.level == logging.INFO
    ours = [h for h in chronostream_logger.handlers if getattr(h, "_chronostream", False)]
    assert len(ours) == 1
    assert logging.getLogger("chronostream.migration").isEnabledFor(logging.INFO)


def test_a_name_that_is_no_level_is_refused(monkeypatch, chronostream_logger):
    monkeypatch.setenv(ENV, "verbose")
    with pytest.raises(ValueError, match="CHRONOSTREAM_LOG='VERBOSE' is not a logging level"):
        configure_from_env()
