"""The worker tests' daemons use the security tests' throw-away CA and work directory."""

from tests.security.conftest import ca, workdir  # noqa: F401 - fixtures, shared rather than written again
