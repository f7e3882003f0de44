"""The command line: every subcommand's help prints (argparse formats help
strings with %, so a stray percent sign in any option's help breaks --help)."""

import pytest

from clawcomm.cli import main

COMMANDS = [
    ["bench"],
    ["experiment", "compression"],
    ["train"],
    ["flight"],
    ["simulate"],
    ["tokenize"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_subcommand_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: clawcomm " + " ".join(command))
