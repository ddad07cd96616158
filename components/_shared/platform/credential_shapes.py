"""The shapes of values that are credentials, and `redact`, which hides them in a text a person or a log will read.

Detected by their published shapes: AWS access key ids, GitHub, Hugging Face, OpenAI, Slack, Google API keys,
Databricks tokens, JWTs, PEM private keys, AWS session tokens, bearer tokens and `--*token=` / `--*auth=` style
flags; URLs carrying a password (`scheme://user:pw@`) or a
credential in their query. pipelines/credentials.py refuses them in presets and parameters; every `error:` message
and every failure a stage records passes through `shown` (redacted and capped: platform/user_errors.py,
launch/runner.py), so a token typed in the wrong place is named as a credential and never printed back.
"""

from __future__ import annotations

import re

SHAPES = (
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)[0-9A-Z]{16}\b")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})\b")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("an OpenAI-style API key", re.compile(r"\bsk-(?:proj-)?[A-Za-z0-9_-]{20,}\b")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b")),
    ("a Databricks token", re.compile(r"\bdapi[0-9a-f]{32}\b")),
    ("a JSON web token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a URL with a password", re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:[^/\s@]+@")),
    ("a bearer token", re.compile(r"\bBearer\s+[A-Za-z0-9._~+/=-]{16,}")),
    (
        "a credential given as a command-line flag",
        re.compile(r"--[\w-]*(?:token|secret|password|passwd|api-?key|auth)[\w-]*=\S{8,}", re.IGNORECASE),
    ),
    # AWS session tokens are base64 of a protobuf whose first bytes are fixed: "IQoJb3JpZ2lu..." today, "FwoG..." before
    ("an AWS session token", re.compile(r"\b(?:IQoJb3JpZ2lu|FwoGZXIvYXdz|FQoGZXIvYXdz)[A-Za-z0-9/+=]{16,}")),
    (
        "a URL whose query carries a credential",
        re.compile(
            r"[?&;](?:x-amz-(?:security-token|credential|signature)|aws_(?:secret_access_key|session_token|access_key_id)"
            r"|(?:access_|auth_|session_|id_)?token|secret(?:_key)?|password|passwd|api_?key|key|sig|signature)=[^&\s]+",
            re.IGNORECASE,
        ),
    ),
)
HIDDEN = "<a credential, hidden>"


def redact(text: str) -> str:
    """`text` with every credential-shaped part replaced by HIDDEN (a URL keeps its scheme and host)."""
    text = re.sub(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s:@'\"]+:[^/\s@'\"]+@", rf"\1{HIDDEN}@", text)
    for _, shape in sorted(SHAPES, key=lambda kind: "query" not in kind[0]):  # a whole query parameter first
        text = shape.sub(lambda m: (m.group(0)[0] if m.group(0)[0] in "?&;" else "") + HIDDEN, text)
    return text


def shown(text: str, limit: int) -> str:
    """`text` as an error or record shows it: credentials hidden, at most `limit` characters (then how many more)."""
    text = redact(text)
    return text if len(text) <= limit else text[:limit] + f" ... [{len(text) - limit} more characters]"
