"""Process-wide switches read by lower layers and set by entry points (a leaf module: importing it
imports nothing of titan_ext, so the runtime can read what ``titan_ext.train`` sets without importing
an upper layer)."""

DEFER_ENV_STRAGGLER = False
"""Set by ``titan_ext.train`` before anything imports ``titan_ext.runtime``: TITAN_EXT_INJECT_DELAYS is then
checked against the job (one line, exit 2) and installed once the process group exists, instead of at
that import (where a malformed value was a traceback and a link beyond the pipeline was announced)."""

DEFER_SECTION_CHECK = False
"""Set by ``titan_ext.train`` while it parses the command line: ``TitanExt.__post_init__`` then leaves the
section's checks to ``check_job_config`` (one line, exit 2) instead of raising inside TorchTitan's
parser (which prints a boxed help text on every rank)."""
