"""Every vocabulary of the protocol, as enums: what a value on the wire may be.

Both sides import these; a value outside an enum is a bad body (dropped and counted). Nothing here
imports anything else of the project, so any module can use the vocabulary.
"""

from __future__ import annotations

from enum import Enum


class MessageKind(str, Enum):
    """Every kind of message on the wire (the envelope's ``k``)."""

    PLAN = "plan"
    STATE = "state"
    COMMAND = "cmd"
    ACTIVATION = "act"
    ACTIVATIONS = "acts"  # several micro-batches' inputs for one holder, in one frame
    GRADIENT = "grad"
    RESULT = "result"
    RESULTS = "results"  # the reports one computation made, in one frame
    WEIGHTS = "weights"
    REDUCE = "reduce"
    PROGRESS = "progress"
    STATUS = "status"
    HEARTBEAT = "hb"
    EVENT = "event"
    CHUNK = "chunk"
    ROSTER = "roster"  # the public keys of the job's identities, signed by the controller
    SPANS = "spans"  # a device's timeline since its last batch (``ftpipe-iot trace``)
    # collaborative and federated modes (docs/design.md §13)
    COLLAB_JOB = "c_job"
    COLLAB_OFFER = "c_offer"
    COLLAB_PLAN = "c_plan"
    COLLAB_ROUND = "c_round"
    SMASHED = "c_act"
    COLLAB_UPDATE = "c_update"
    COLLAB_REPORT = "c_report"
    COLLAB_STATUS = "c_status"
    COLLAB_RESTART = "c_restart"


class WireCodec(str, Enum):
    """How the stage data (activations, their gradients) goes on the wire
    (``protocol.codecs``): as it is, or coded with fewer bytes, deterministically."""

    NONE = "none"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"


class CutDirection(str, Enum):
    """Which way stage data crosses a cut between stages k and k + 1: activations go forward
    (k to k + 1), their gradients go backward (k + 1 to k). Each has its own codec."""

    FORWARD = "forward"
    BACKWARD = "backward"


class OptimizerName(str, Enum):
    """Optimizers a stage can run (one instance per layer, so per-layer state can be replicated)."""

    SGD = "sgd"
    ADAM = "adam"


class ScheduleName(str, Enum):
    """How steps follow each other (docs/design.md §5): ``sync`` drains the pipeline every step;
    ``1f1b`` drains every step too, with at most one micro-batch in flight per stage
    (PipeDream-Flush: sync's weights, less activation memory); ``async`` runs 1F1B across steps,
    each micro-batch at the newest weights 1F1B's order lets exist (a stage's first few of a
    step at the previous version, two versions at most), and drains only where a consistent
    version is needed (replication points, evaluations, epoch ends)."""

    SYNC = "sync"
    FLUSH = "1f1b"
    ASYNC = "async"


class DelayCompensation(str, Enum):
    """How the asynchronous schedule makes up for its one-step-stale weights (docs/design.md
    §5): ``predict`` computes a stale micro-batch at the weights its step's update will reach,
    predicted from the optimizer's own state (weight prediction, as SpecTrain and XPipe do);
    ``none`` computes it at the previous version, as PipeDream-2BW specifies."""

    PREDICT = "predict"
    NONE = "none"


class SpanKind(str, Enum):
    """What a process was doing over one span of its timeline (docs/design.md §9). Devices
    record the compute, send, receive and wait kinds; the controller its feeding and steps."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"          # the optimizer's step (and, async, the weight stash)
    EXCHANGE = "exchange"            # a group applying its members' gradients
    EVALUATE = "evaluate"
    SEND = "send"                    # encoding and publishing one message
    RECEIVE = "receive"              # decoding and checking one message
    LINK = "link"                    # an emulated link's transfer time (a profile's cap)
    WAIT_INPUT = "wait_input"        # idle until an activation (or the raw input) came
    WAIT_GRADIENT = "wait_gradient"  # idle until the next stage's gradient came
    WAIT_EXCHANGE = "wait_exchange"  # idle until another member's contribution came
    WAIT = "wait"                    # idle until anything else came
    REPLICATE = "replicate"          # publishing the held layers' replicas
    FEED = "feed"                    # the controller publishing a micro-batch's inputs
    STEP = "step"                    # the controller: first input sent to the step's end


class DeviceState(str, Enum):
    """A device agent as published on its retained status topic (and its Last Will)."""

    ONLINE = "online"
    OFFLINE = "offline"


class ControllerStatus(str, Enum):
    """The controller as published on the retained state topic (and its Last Will)."""

    ONLINE = "online"
    TRAINING = "training"
    DONE = "done"
    FAILED = "failed"
    OFFLINE = "offline"


class ControllerPhase(str, Enum):
    """Where the controller is in the job (published with its state)."""

    RESUMING = "resuming"
    WAITING_DEVICES = "waiting_devices"
    DEPLOYING = "deploying"
    TRAINING = "training"
    REPLICATING = "replicating"
    DONE = "done"
    FAILED = "failed"


class CommandOp(str, Enum):
    """Commands the controller sends to one device."""

    REPLICATE = "replicate"
    SHUTDOWN = "shutdown"
    TAKE_OVER = "take_over"  # the named holders of your stage are gone: compute theirs now
    REPLICATE_EVERY = "replicate_every"  # replicate at this interval from now on


class ResultType(str, Enum):
    """What a message on the results topic reports."""

    READY = "ready"
    LOSS = "loss"
    EVAL = "eval"
    MICRO_BATCH_DONE = "mb_done"
    STEP_DONE = "step_done"
    REPLICATED = "replicated"
    MISSING = "missing"
    PROBED = "probed"
    ERROR = "error"


class EventType(str, Enum):
    """Events the controller publishes on the job's events topic."""

    PLAN_CHANGED = "plan_changed"
    TRAINING_STARTED = "training_started"
    EPOCH_EVALUATED = "epoch_evaluated"
    FAILURE_DETECTED = "failure_detected"
    RECOVERY_DONE = "recovery_done"
    FAILURE_COVERED = "failure_covered"  # peers took over: no rollback
    REPARTITIONED = "repartitioned"
    SHARES_CHANGED = "shares_changed"
    REPLICATION_PACED = "replication_paced"  # a new interval (steps) from at_step on
    JOB_DONE = "job_done"
    JOB_FAILED = "job_failed"
    ROUND_COMPLETED = "round_completed"


class FailureCause(str, Enum):
    """Why the controller decided something failed."""

    LAST_WILL = "last_will"
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    STALLED_STEP = "stalled_step"
    CONNECTION_LOST = "connection_lost"
    NOT_READY = "not_ready"


class DropReason(str, Enum):
    """Every ``reason`` label of ``ftpipe_messages_dropped_total``; each is exported at zero from
    the start, so dashboards and alerts see a series (and a rate of 0) before the first drop."""

    # the frame itself
    MALFORMED = "malformed"
    UNKNOWN_VERSION = "unknown_version"
    UNKNOWN_KIND = "unknown_kind"
    BAD_CHECKSUM = "bad_checksum"
    OVERSIZED = "oversized"
    # who sent it (docs/security.md)
    BAD_SIGNATURE = "bad_signature"
    REPLAYED = "replayed"
    # the body
    BAD_BODY = "bad_body"
    BAD_PLAN = "bad_plan"
    UNTRUSTED_PLAN = "untrusted_plan"
    UNEXPECTED_KIND = "unexpected_kind"
    # where it belongs
    WRONG_JOB = "wrong_job"
    STALE_PLAN = "stale_plan"
    FUTURE_PLAN = "future_plan"
    STALE_RUN = "stale_run"
    NO_STAGE = "no_stage"
    NOT_READY = "not_ready"
    # what a stage can use
    BAD_TENSOR = "bad_tensor"
    BAD_SHAPE = "bad_shape"
    BAD_LABEL = "bad_label"
    DUPLICATE = "duplicate"
    LATE = "late"  # a result another holder of the stage delivered first
    UNEXPECTED = "unexpected"


class CollabMode(str, Enum):
    """How a job trains: the pipeline of stages, PiPar's collaborative split learning (data stays
    on the devices, a server holds the middle of the model) or plain federated averaging."""

    PIPELINE = "pipeline"
    COLLABORATIVE = "collaborative"
    FEDAVG = "fedavg"


class CollabRole(str, Enum):
    """What a device offers in the collaborative and federated modes."""

    DATA = "data"
    SERVER = "server"


class MemberState(str, Enum):
    """A data-owning device in the current round, as the coordinator publishes it."""

    TRAINING = "training"
    DONE = "done"
    DROPPED = "dropped"
    WAITING = "waiting"
