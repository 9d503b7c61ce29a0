"""Root pytest configuration.

A session in which nothing passed (everything skipped or deselected) must not look green in CI:
pytest itself exits 5 only when nothing was collected.
"""


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0 or session.config.option.collectonly:
        return
    if getattr(session.config, "workerinput", None) is not None:
        return  # xdist workers report to the controller, which decides
    if not reporter.stats.get("passed"):
        reporter.write_line("error: no test passed in this session", red=True)
        session.exitstatus = 1
