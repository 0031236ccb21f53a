"""`python -m bench` names an unknown peer or model instead of failing inside the run."""

from __future__ import annotations

import pytest

from bench.run import main


@pytest.mark.parametrize(("args", "message"), [
    (["--peers", "legacy,ortt"], "unknown peer(s) ['ortt']"),
    (["--models", "mlp64,mlp"], "unknown model(s) ['mlp']"),
])
def test_unknown_names_are_usage_errors(args, message, capsys) -> None:
    pytest.importorskip("torch")
    with pytest.raises(SystemExit) as e:
        main(["--quick", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
