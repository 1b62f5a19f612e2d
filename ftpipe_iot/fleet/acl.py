"""The Mosquitto ACL file: which identity may read or write which topic.

Mosquitto 2.0 ``acl_file`` semantics this relies on (src/security_default.c, 2.0.x):

* A client's ``user`` block is checked first, then the ``pattern`` lines; the first entry whose
  topic filter matches and whose access includes the requested one grants it; anything not granted
  is denied. ``%u`` in a pattern is replaced by the client's username; clients whose username or
  client id contains ``+`` or ``#`` are denied outright (``topics.check_name`` rejects those).
* PUBLISH is checked with ``write`` (denied messages are dropped silently; QoS 1 still gets its
  PUBACK) and delivery with ``read``, retained messages included.
* SUBSCRIBE is *not* checked by the ACL file in 2.0 (a ``#`` subscription gets a success SUBACK),
  so "only the operator may subscribe to ``#``" holds on delivery: every other identity's ``#``
  subscription receives only what its ``read`` rules allow.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from ftpipe_iot.fleet.model import Identity, Role
from ftpipe_iot.fleet.site import Direction, bridge_topics
from ftpipe_iot.protocol.topics import ROOT, Topics


class Access(str, Enum):
    """Mosquitto ACL access words."""

    READ = "read"
    WRITE = "write"
    READWRITE = "readwrite"


@dataclass(frozen=True)
class Rule:
    """One ACL line: ``topic``/``pattern`` with an access and a topic filter."""

    access: Access
    topic: str
    pattern: bool = False

    def render(self) -> str:
        """The line as Mosquitto reads it."""
        return f"{'pattern' if self.pattern else 'topic'} {self.access.value} {self.topic}"


def pattern_rules() -> list[Rule]:
    """Rules every authenticated identity gets, written once with ``%u`` (= its own name)."""
    return [
        # Own liveness topics only: a device cannot fake another device's status or Last Will.
        Rule(Access.WRITE, Topics.dev_status("%u"), pattern=True),
        Rule(Access.WRITE, Topics.dev_heartbeat("%u"), pattern=True),
        # Own timeline in any job: another device's spans cannot be forged into a trace.
        Rule(Access.WRITE, f"{ROOT}/+/trace/%u", pattern=True),
        # Own command topic in any job; commands for other devices stay private.
        Rule(Access.READ, f"{ROOT}/+/ctrl/cmd/%u", pattern=True),
        # Collaborative modes: a data device's offer, its activations up and gradients down are
        # its own; another device's stay private (they are derived from its data).
        Rule(Access.WRITE, f"{ROOT}/+/collab/offer/%u", pattern=True),
        Rule(Access.WRITE, f"{ROOT}/+/collab/up/%u", pattern=True),
        Rule(Access.READ, f"{ROOT}/+/collab/down/%u", pattern=True),
    ]


def role_rules(role: Role, job: str) -> list[Rule]:
    """The per-user rules of one identity in ``job``."""
    t = Topics(job)
    if role in (Role.DEVICE, Role.SERVER):
        rules = [
            Rule(Access.READ, t.plan),
            Rule(Access.READ, t.state),          # notice a controller that went offline (LWT)
            Rule(Access.READ, t.roster),         # the public keys messages are checked with
            Rule(Access.READWRITE, f"{t.base}/stage/#"),   # any stage: plans move stages
            Rule(Access.READWRITE, f"{t.base}/weights/#"),  # replicate, and load on takeover
            Rule(Access.WRITE, t.results),
            # collaborative modes: the coordinator's job, plan and rounds; own contributions
            *(Rule(Access.READ, topic) for topic in (t.collab_job, t.collab_plan,
                                                     t.collab_round, t.collab_status)),
            Rule(Access.WRITE, t.collab_update),
            Rule(Access.WRITE, t.collab_report),
        ]
        if role is Role.SERVER:  # the server part: every data device's activations
            rules += [Rule(Access.READ, t.collab_up_all),
                      Rule(Access.WRITE, f"{t.base}/collab/down/+")]
        return rules
    if role is Role.CONTROLLER:
        return [
            Rule(Access.READWRITE, f"{t.base}/ctrl/#"),  # the only writer of plan/state/cmd
            Rule(Access.READWRITE, f"{t.base}/collab/#"),  # the collaborative coordinator
            Rule(Access.WRITE, t.events),
            Rule(Access.READWRITE, f"{t.base}/stage/#"),   # feeds stage 0, drains the last
            Rule(Access.READWRITE, f"{t.base}/weights/#"),  # central replica; may republish
            Rule(Access.READ, t.results),
            Rule(Access.READ, t.trace_all),
            Rule(Access.READ, Topics.ALL_STATUS),
            Rule(Access.READ, Topics.ALL_HEARTBEATS),
        ]
    if role is Role.SITE:
        # The bridge reads what comes in and writes what goes out (fleet/site.py's topic map);
        # it relays the statuses and heartbeats of every device of its site.
        access = {Direction.IN: Access.READ, Direction.OUT: Access.WRITE,
                  Direction.BOTH: Access.READWRITE}
        return [Rule(access[t.direction], t.pattern) for t in bridge_topics(job)]
    # Operator: observe everything (including broker statistics), write nothing of its own.
    return [Rule(Access.READ, "#"), Rule(Access.READ, "$SYS/#")]


def render_acl(identities: Iterable[Identity]) -> str:
    """The complete ACL file for these identities (deterministic order, comments on own lines:
    Mosquitto has no inline comments, a trailing ``# ...`` would become part of the topic)."""
    lines = [
        "# Generated by `ftpipe-iot fleet`; changes here are overwritten. See docs/security.md.",
        "# No rules before the first 'user' line: anonymous clients get no access at all.",
        "",
        "# Every identity, %u = its username (which is also its client id).",
        *(rule.render() for rule in pattern_rules()),
    ]
    for ident in sorted(identities, key=lambda i: i.name):
        lines += ["", f"# {ident.role.value}, job {ident.job}", f"user {ident.name}"]
        lines += [rule.render() for rule in role_rules(ident.role, ident.job)]
    return "\n".join(lines) + "\n"
