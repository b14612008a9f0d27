"""What counts as a secret, for everything that prints, writes or logs a configuration: a config leaf
whose NAME looks like a secret (``api_key``, ``password``, ``hf_token``, ...) and any string equal to the
value of an environment variable whose NAME looks like a secret (``*KEY*``, ``*TOKEN*``, ...), and the
credentials inside any URL (``http://user:PASSWORD@host/...``: :func:`mask_url_credentials`).

The resolved config written to the run directory (:func:`trainer.config.load.public_container`) and the
trackers' params (:func:`trainer.tracking.redact`) mask by these same rules.
"""

from __future__ import annotations

import os
import re

# A config leaf holding a secret itself (``api_key_env`` only names a variable, so it stays visible).
SECRET_KEY = re.compile(r"(api_?key|secret|password|passwd|credential|auth_token|access_token|hf_token)$", re.I)
# Environment variables whose values are secrets wherever they appear.
SECRET_ENV = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL)", re.I)


# Credentials inside a URL (``scheme://user:PASSWORD@host``, ``scheme://TOKEN@host``): the userinfo part.
URL_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/?#@\s]+)@", re.I)


def mask_url_credentials(text: str) -> str:
    """``text`` with every URL's credentials masked: ``http://user:PASS@host`` -> ``http://user:***@host``,
    ``https://TOKEN@host`` -> ``https://***@host`` (a lone userinfo is a token as often as a name)."""
    def mask(m: re.Match) -> str:
        user, sep, _ = m.group("userinfo").partition(":")
        return f"{m.group('scheme')}{user}:***@" if sep else f"{m.group('scheme')}***@"

    return URL_USERINFO.sub(mask, text)


def secret_values() -> set[str]:
    """The values of this process's secret-looking environment variables (6 characters or more: shorter
    values would mask ordinary words)."""
    return {v for k, v in os.environ.items() if SECRET_ENV.search(k) and len(v) >= 6}
