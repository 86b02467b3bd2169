"""Environment switches: one set of words for every WATCHDOGD_* switch."""

from __future__ import annotations

import logging

import pytest

import watchdogd_client
from watchdogd_client import Client, NullClient, configure
from watchdogd_client.switches import DISABLE, env_switch, parse_switch


@pytest.mark.parametrize("word", ["1", "true", "yes", "on", "TRUE", " On ", "Yes"])
def test_words_that_turn_a_switch_on(word: str) -> None:
    assert parse_switch(word) is True


@pytest.mark.parametrize("word", ["0", "false", "no", "off", "", "  ", "OFF", "No"])
def test_words_that_turn_a_switch_off(word: str) -> None:
    assert parse_switch(word) is False


@pytest.mark.parametrize("word", ["2", "ture", "enable", "y", "-1", "disabled"])
def test_anything_else_is_not_a_choice(word: str) -> None:
    assert parse_switch(word) is None


def test_a_typo_keeps_the_default_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WATCHDOGD_TEST_SWITCH", "ture")
    with caplog.at_level(logging.WARNING, logger="watchdogd_client"):
        assert env_switch("WATCHDOGD_TEST_SWITCH") is False
        assert env_switch("WATCHDOGD_TEST_SWITCH", default=True) is True
    [first, second] = caplog.records
    assert "ignoring WATCHDOGD_TEST_SWITCH='ture'" in first.getMessage()
    assert "1, true, yes or on" in first.getMessage()
    assert first.getMessage().endswith("it stays off")
    assert second.getMessage().endswith("it stays on")


def test_unset_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOGD_TEST_SWITCH", raising=False)
    assert env_switch("WATCHDOGD_TEST_SWITCH") is False
    assert env_switch("WATCHDOGD_TEST_SWITCH", default=True) is True


@pytest.mark.parametrize(
    ("value", "null"),
    [("1", True), ("yes", True), ("on", True), ("0", False), ("off", False), ("", False)],
)
def test_disable_reads_the_same_words(
    monkeypatch: pytest.MonkeyPatch, value: str, null: bool
) -> None:
    monkeypatch.setenv(DISABLE, value)
    monkeypatch.setenv("WATCHDOGD_SOCKET", "/nonexistent/watchdogd.sock")
    configure(None)
    try:
        default = watchdogd_client.default_client()
        assert isinstance(default, NullClient) is null
        assert isinstance(default, Client) is not null
    finally:
        configure(None)


def test_disable_with_a_typo_stays_protected(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(DISABLE, "treu")
    monkeypatch.setenv("WATCHDOGD_SOCKET", "/nonexistent/watchdogd.sock")
    configure(None)
    try:
        with caplog.at_level(logging.WARNING, logger="watchdogd_client"):
            assert isinstance(watchdogd_client.default_client(), Client)
        assert "ignoring WATCHDOGD_DISABLE='treu'" in caplog.text
    finally:
        configure(None)
