"""The assignments' grader: each submitted notebook run in confined child processes, and graded.

Kept apart from the book's library, as nbgrader and otter keep the grader apart from the course
material: ``utils`` (and its ``utils.checks``, the checkers a notebook imports to check an
exercise) never imports this package, and the architecture test holds that. This package uses
the checkers (their cases, references and rules) and adds everything that only grading needs.
`scripts/grade_assignments.py` (``make grade``) is its command line.

The grader's process:

* `sandbox`: `grade_notebook` and `Grading`, one notebook graded case by case, and
  `SubmissionResult`, its grade;
* `sessions` (the conversation with the children), `children` (one child process, its scratch
  folder and its frames), `zygote_client` (the grader's end of the zygote), `limits` (`Limits`,
  the child's environment), `messages` (the schema of every message a child sends);
* `policy` (what a child may read and what it must poison) and `scan` (the static scan of a
  notebook's imports, in a bounded process of its own);
* `submissions` (which student handed in which notebook), `notebook_reading` (a notebook's code
  and written answers, read under bounds) and `sanitize` (every untrusted string made safe for
  the output files).

The processes it starts, and what they import:

* `zygote`: started once (``python -I -B -m grader.zygote``), imports torch, `child` and the
  student side of the checkers (`utils.checks.core`, `utils.checks.results`,
  `utils.checks.runners`), never a checker's reference, and forks one child per request;
* `child`: the sandboxed child that runs one submission's code (``python -I -B -m
  grader.child`` where there is no fork), with `ipython_shell` (what stands for IPython),
  `poison` with `families` (forbidden code replaced before the student's first line) and
  `kernel`, the kernel's confinement, on `namespaces` (a PID namespace per child, made by the
  zygote, and the child's other namespaces and tmpfs scratch folder), `landlock`, `seccomp`,
  `processes` and `syscalls`;
* `protocol`: the bounded frames both sides write and read.

A child confines itself after it has imported all of the above: under Landlock it can read
neither ``grader/`` nor ``utils/checks/``.
"""
