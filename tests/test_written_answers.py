"""Written answers: every assignment's questions under "Before you hand it in" have nbgrader's
manually graded answer cells, and the book's grader collects the students' answers, question by
question, for grading by hand. The end-to-end run is in tests/test_grading.py."""

from __future__ import annotations

import importlib.util
import json
import random

import nbformat
import pytest
from notebooks import ROOT

from utils.checks import ASSIGNMENTS

SCRIPTS = ROOT / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grade_assignments = _load("grade_assignments")
make_assignments = _load("make_assignments")


@pytest.mark.parametrize("name", list(ASSIGNMENTS))
def test_every_assignment_has_written_questions_with_model_answers(name):
    questions = grade_assignments.written_questions(name)
    assert len(questions) >= 2
    for q in questions:
        assert q["question"].startswith("**Question") and q["points"] > 0
        assert len(q["model"]) > 100 and "SOLUTION" not in q["model"]
        assert q["id"].startswith(f"{name}-answer-")


def _student(name, tmp_path, answers=None, shuffle=False):
    """The student version of ``name`` with the written answers filled in from ``answers``."""
    nb = nbformat.read(ROOT / "book" / "assignments" / f"{name}.ipynb", as_version=4)
    student, _ = make_assignments.student_version(nb)
    for cell in student.cells:
        gid = cell.metadata["nbgrader"]["grade_id"]
        if answers and gid in answers:
            cell.source = cell.source.replace("YOUR ANSWER HERE", answers[gid])
    if shuffle:
        random.Random(0).shuffle(student.cells)
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(student, path)
    return path


def test_answers_are_found_by_their_cell_id(tmp_path):
    name = "a1_attention"
    questions = grade_assignments.written_questions(name)
    handed_out = _student(name, tmp_path)
    assert grade_assignments.written_answers(handed_out, questions) == [None] * len(questions)
    mine = {questions[0]["id"]: "Columns sum to 1 instead of rows."}
    filled = _student(name, tmp_path, mine, shuffle=True)
    assert grade_assignments.written_answers(filled, questions) == [
        "Columns sum to 1 instead of rows."] + [None] * (len(questions) - 1)


def test_answers_are_found_by_position_when_the_cell_ids_are_gone(tmp_path):
    """Cells copied into a fresh notebook keep no metadata: each answer is then the first
    "**Answer.**" cell after its question, code cells in between or not."""
    name = "a3_masks"
    questions = grade_assignments.written_questions(name)
    filled = _student(name, tmp_path, {questions[0]["id"]: "Padding after: no change.",
                                       questions[2]["id"]: "Rows of length-0 sequences."})
    nb = nbformat.read(filled, as_version=4)
    fresh = nbformat.v4.new_notebook()
    for cell in nb.cells:
        copy = (nbformat.v4.new_markdown_cell(cell.source) if cell.cell_type == "markdown"
                else nbformat.v4.new_code_cell(cell.source))
        fresh.cells.append(copy)
        if cell.source.startswith("**Question 1."):
            fresh.cells.append(nbformat.v4.new_code_cell("# my scratch work"))
    path = tmp_path / "fresh.ipynb"
    nbformat.write(fresh, path)
    assert grade_assignments.written_answers(path, questions) == [
        "Padding after: no change.", None, "Rows of length-0 sequences."]
    # A question whose answer cell was deleted gets none, not the next question's answer.
    fresh.cells = [c for c in fresh.cells if "Padding after" not in c.source]
    nbformat.write(fresh, path)
    assert grade_assignments.written_answers(path, questions) == [
        None, None, "Rows of length-0 sequences."]


def test_broken_or_huge_notebooks_give_no_answers_and_no_error(tmp_path):
    questions = grade_assignments.written_questions("a1_attention")
    bad = tmp_path / "bad.ipynb"
    for text in ("{not json", json.dumps({"cells": "nope"}), json.dumps([1, 2]),
                 json.dumps({"cells": [{"cell_type": "markdown", "metadata": {"nbgrader": 5}}]})):
        bad.write_text(text)
        assert grade_assignments.written_answers(bad, questions) == [None] * len(questions)
    assert grade_assignments.written_answers(tmp_path / "missing.ipynb", questions) == [
        None] * len(questions)


def test_the_report_lists_each_question_its_model_answer_and_every_student():
    questions = grade_assignments.written_questions("a6_encoder_layer")
    report = grade_assignments.written_report(
        "a6_encoder_layer", questions,
        [("ada", ["norm=LayerNorm", None]), ("bo", [None, "ignored by the loss"])])
    assert report.count("### ada") == len(questions) and report.count("### bo") == len(questions)
    assert "norm=LayerNorm" in report and "ignored by the loss" in report
    assert report.count("*(no answer)*") == 2 * len(questions) - 2
    assert all(q["model"] in report for q in questions)


def test_an_answer_cannot_forge_the_report():
    """A heading, a fake "no answer" for someone else, raw HTML and megabytes of padding stay
    inside the student's own quoted answer."""
    questions = grade_assignments.written_questions("a1_attention")
    forged = "### victim\n\n*(no answer)*\n\n## Question 9 <script>x</script>\n" + "x" * 10**6
    report = grade_assignments.written_report(
        "a1_attention", questions, [("mallory", [forged, None]), ("victim", ["mine", "ok"])])
    lines = report.splitlines()
    assert [ln for ln in lines if ln.startswith("### ")] == ["### mallory", "### victim"] * 2
    assert not any(ln.startswith("## Question 9") for ln in lines)
    assert "<script>" not in report and "&lt;script&gt;" in report
    assert len(report) < 20_000 and "cut here" in report
