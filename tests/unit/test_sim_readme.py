"""``libs/loom/sim/README.md``: its table of true speeds against the belief is what the code gives
(the README's own snippet, run on the packaged truth and the profile library)."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "libs" / "loom" / "sim" / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("True speed (and, in brackets, the SCU placement believes)")
    return text[start : text.index("\n\n", text.index("| recommendation |", start))]


def test_the_true_speed_table_is_the_output_of_the_snippet_beside_it() -> None:
    section = _section()
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet, str(README), "exec"), {})  # the README's own snippet
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert printed.getvalue().splitlines() == table


def test_the_text_under_the_table_quotes_the_a100_figures_the_way_round_they_are() -> None:
    from loom.model.profiles import relative_speed
    from loom.sim.truth import load_truth

    true = load_truth().speed("resnet-50", "A100", precision="fp32").speed
    belief = relative_speed("A100", "training_compute")
    assert belief > true  # the belief overrates the A100 on ResNet-50 today
    text = " ".join(README.read_text().split())
    assert "**overrates** the A100-class" in text
    assert f"ResNet-50 is believed {belief:.2f} on an A100 against a true {true:.2f}" in text
