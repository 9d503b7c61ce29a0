"""Accuracy gates through lm-eval, on every engine (docs/design.md, "Accuracy").

- ``spec``: the models.yaml schema of tasks and gates (no heavy imports; harness.matrix uses it);
- ``lm``: ``HarnessLM``, the lm-eval model registered as ``harness``, over any loaded engine;
- ``lmeval``: runs a cell's tasks through ``lm_eval.simple_evaluate`` in the engine child;
- ``gates``: the checks, against the baseline and across engines;
- ``store``: the accuracy baselines, ``baselines/<tier>/accuracy/<cell id>.json``;
- ``build``: the offline tiny tasks whose gold answers are the unquantized fixture's choices;
- ``faults``: test-only degradations (``HARNESS_TEST_HOOK``) that the gates must catch.

Importing this package imports neither torch nor lm-eval. Its modules sit in different layers
(pyproject.toml, the import contract): ``spec`` with the matrix, ``lm`` and ``lmeval`` with the
engines, ``faults`` with the engine child, ``gates`` and ``store`` with the comparison, ``build``
with the commands.
"""
