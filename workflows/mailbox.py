"""E-mail addresses a document names (an approval's ``approvers.emails``): parsed once, by
:func:`mailbox`, into the address mail is delivered to.

Why one strict parser: a rule that reads an address one way while the mailer reads it
another is no rule. ``x@evil.com(@example.com`` ends in ``example.com`` to a check that takes
the text after the last ``@``, and is a mailbox at ``evil.com`` with a comment to Django's
SMTP backend (``sanitize_address``, an RFC 5322 parser), which sends it there. So the domain
rule (``DJFLOW_APPROVER_EMAIL_DOMAINS``) and the mailer both use what this returns.

Invariants:

- An entry is exactly one bare mailbox, ``local@domain``, in printable ASCII: no display
  name, angle brackets, comment, list, group, quoted local part, source route, domain
  literal, whitespace, CR/LF or NUL. Anything else raises :class:`MailboxProblem`; nothing
  is guessed or repaired.
- The local part is a dot-atom without ``%`` or ``!`` (the percent hack and bang paths ask a
  relay to forward to another host: the domain checked would not be the one that reads it).
- The domain is letters, digits and hyphens in dot-separated labels (at least two), no
  trailing dot. An international domain is written in its ``xn--`` form: Unicode text is
  refused, since IDNA maps look-alikes (fullwidth letters, U+FF43 for ``c``) to another
  domain than the one a person reads, and Django's mailer encodes it so.
- The result is the entry with its domain in lower case, and Django's own
  ``sanitize_address`` gives it back unchanged: what the rule checked is what RCPT TO says.
"""

from __future__ import annotations

from email.errors import HeaderParseError
from email.headerregistry import Address

from django.core.mail.message import sanitize_address

# RFC 5321's limits: a path of at most 256 octets with its brackets, a local part of 64.
MAX_ADDRESS = 254
MAX_LOCAL = 64
MAX_LABEL = 63

_ATEXT = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789#$&'*+-/=?^_`{|}~"
)
_LDH = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")

SHAPE = (
    "must be one bare e-mail address, local@domain, in ASCII: no name, <>, comment, list, "
    "group, quotes or spaces (an international domain in its xn-- form)"
)


class MailboxProblem(ValueError):
    """Why an entry is not one bare mailbox (the message reads after the field's name)."""


def mailbox(text: object) -> str:
    """The address ``text`` delivers to (its domain in lower case), or
    :class:`MailboxProblem` saying why it is not exactly one bare mailbox."""
    if not isinstance(text, str):
        raise MailboxProblem("must be a string")
    if not text or len(text) > MAX_ADDRESS:
        raise MailboxProblem(f"must be 3 to {MAX_ADDRESS} characters")
    if any(not ("!" <= char <= "~") for char in text) or '"' in text:
        raise MailboxProblem(SHAPE)
    try:
        parsed = Address(addr_spec=text)
    except (HeaderParseError, ValueError, IndexError):
        raise MailboxProblem(SHAPE) from None
    local, domain = parsed.username, parsed.domain
    if f"{local}@{domain}" != text or text.count("@") != 1:
        raise MailboxProblem(SHAPE)
    _check_local(local)
    normal = f"{local}@{_checked_domain(domain)}"
    # Django's SMTP backend passes every recipient through sanitize_address: it must read
    # this address as this address (no comment dropped, no domain re-encoded).
    try:
        delivered = sanitize_address(normal, "utf-8")
    except ValueError:
        raise MailboxProblem(SHAPE) from None
    if delivered != normal:
        raise MailboxProblem(SHAPE)
    return normal


def domain_of(address: str) -> str:
    """The domain of an address :func:`mailbox` returned."""
    return address.rpartition("@")[2]


def _check_local(local: str) -> None:
    if not local or len(local) > MAX_LOCAL:
        raise MailboxProblem(f"the part before @ must be 1 to {MAX_LOCAL} characters")
    if any(not atom or not set(atom) <= _ATEXT for atom in local.split(".")):
        raise MailboxProblem(
            "the part before @ may hold letters, digits, dots between them and "
            "#$&'*+-/=?^_`{|}~, not % or ! (they ask a relay to forward elsewhere)"
        )


def _checked_domain(domain: str) -> str:
    lowered = domain.lower()
    labels = lowered.split(".")
    if len(labels) < 2 or any(
        not label
        or len(label) > MAX_LABEL
        or not set(label) <= _LDH
        or label.startswith("-")
        or label.endswith("-")
        for label in labels
    ):
        raise MailboxProblem(
            "the domain must be dot-separated labels of letters, digits and hyphens, such "
            "as example.com (no trailing dot, no [address])"
        )
    return lowered
