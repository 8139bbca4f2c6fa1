"""The project's own suite runs on the veosnap pytest plugin."""

from importlib.metadata import entry_points

# An installed veosnap registers the plugin through its `pytest11` entry point; a checkout run with
# PYTHONPATH pointing at it (and an older install's metadata) does not, so load it here instead.
if not any(ep.value == "veosnap.pytest_plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["veosnap.pytest_plugin"]
