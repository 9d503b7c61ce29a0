"""Root pytest configuration.

A session in which nothing passed (everything skipped or deselected) must not look green in CI:
pytest itself exits 5 only when nothing was collected.

The session counts the engine children and fork servers its tests start (harness.supervise's
ledger, HARNESS_CHILD_LEDGER): the summary names the files that start the most, the figure to watch
when the suite gets slower (BENCHMARKS.md, "CI and the test suites").

A test marked ``slow`` (left out by ``make quick``) says why: ``@pytest.mark.slow("why")``, checked
at collection, before ``-m`` deselects anything.
"""
import collections
import json
import os
import tempfile

import pytest

from harness.supervise import LEDGER_ENV, repeats


def pytest_configure(config):
    if getattr(config, "workerinput", None) is None and not os.environ.get(LEDGER_ENV):
        fd, path = tempfile.mkstemp(prefix="harness-children-", suffix=".jsonl")
        os.close(fd)
        os.environ[LEDGER_ENV] = config._harness_ledger = path  # xdist workers inherit it


def pytest_unconfigure(config):
    path = getattr(config, "_harness_ledger", None)
    if path:
        os.environ.pop(LEDGER_ENV, None)
        os.unlink(path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0].strip()):
            raise pytest.UsageError(f'{item.nodeid}: @pytest.mark.slow needs a reason: slow("why")')


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path = getattr(config, "_harness_ledger", None)
    if not path:
        return
    children, servers, seconds = collections.Counter(), collections.Counter(), collections.Counter()
    environments = set()
    with open(path) as f:
        entries = [json.loads(line) for line in f]
    for entry in entries:
        where = (entry["test"] or "?").split("::")[0]
        if entry["kind"] == "fork-server":
            servers[where, "vllm" in entry["preload"]] += 1
            environments.add(entry["environment"])
        else:
            children[where] += 1
            seconds[where] += entry["seconds"]
    if not children:
        return
    vllm = sum(n for (_, is_vllm), n in servers.items() if is_vllm)
    repeated = repeats(entries)
    terminalreporter.write_sep("-", f"engine children: {sum(children.values())} "
                                    f"({sum(seconds.values()):.0f} s; {len(repeated)} repeating another's job "
                                    f"in its environment, {sum(e['seconds'] for e in repeated):.0f} s), fork servers: "
                                    f"{sum(servers.values())} ({vllm} importing vLLM) for "
                                    f"{len(environments)} environments")
    for where, n in children.most_common(10):
        terminalreporter.write_line(f"{n:5d} children {seconds[where]:7.0f} s  {where}")


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0 or session.config.option.collectonly:
        return
    if getattr(session.config, "workerinput", None) is not None:
        return  # xdist workers report to the controller, which decides
    if not reporter.stats.get("passed"):
        reporter.write_line("error: no test passed in this session", red=True)
        session.exitstatus = 1
