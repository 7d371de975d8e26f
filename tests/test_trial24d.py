"""Newcomer trial 24d: the findings about the app's figures and vLLM's flag names."""

from __future__ import annotations

import pytest

from nanovllm_core.cli import build_parser as nanovllm_parser
from nanovllm_core.cli_args import engine_kwargs
from nanovllm_core.entrypoints import cli as serve_cli
from nanovllm_tui import options
from tests.conftest import run_main

COMMANDS = {"nanovllm": nanovllm_parser, "nanovllm serve": serve_cli.build_parser, "nanovllm-tui": options.build_parser}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("argv, key, value", [
    (["--max-num-batched-tokens", "16"], "max_num_batched_tokens", 16),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--no-prefix-caching", "--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--enable-prefix-caching", "--no-enable-prefix-caching"], "enable_prefix_caching", False),
])
def test_vllm_flag_names_are_aliases_in_every_command(command, argv, key, value):
    """Trial 24d bug 5: docs/engine.md says the vLLM names are kept, but `--max-num-batched-tokens`
    was 'unrecognized arguments' in nanovllm, nanovllm serve and nanovllm-tui. It is an alias of
    this project's flag (same dest), and --help names both."""
    parser = COMMANDS[command]()
    assert engine_kwargs(parser.parse_args(argv))[key] == value
    assert argv[0] in parser.format_help()


@pytest.mark.parametrize("flag", ["--max-num-batched-tokens=16", "--enable-prefix-caching", "--no-enable-prefix",
                                  "--max-prefill-tokens=16"])
def test_an_alias_is_refused_under_connect_as_its_flag_is_and_named_as_typed(capsys, flag):
    code, _, err = run_main(options.build_app, capsys, "--connect", "http://127.0.0.1:9", flag)
    typed = {"--no-enable-prefix": "--no-enable-prefix-caching"}.get(flag, flag.partition("=")[0])
    assert code == 2 and f"{typed} cannot be used with --connect" in err and err.count("\n") == 1, err
    assert f"`nanovllm serve {typed}`" in err


def test_an_alias_given_with_replay_is_named_as_typed(capsys):
    code, _, err = run_main(options.build_app, capsys, "--replay", "tests/data/tui_trace.jsonl.gz",
                            "--max-num-batched-tokens", "16")
    assert code == 2 and "--max-num-batched-tokens does nothing with --replay" in err, err
