"""Replay of an exported run (CONTRACT section 16): ``manage.py run_replay FILE``.

The export (``runs.export``, docs/reference/run-export.md) is loaded into a private SQLite
database of this process, never the deployment's: a copy of a migrated template kept under
``DJFLOW_VAR_DIR/replay/`` (built once per set of migrations), deleted when the replay ends.
There the run is forked (``runs.forks``, from ``--from-step`` or from the start, on the
document, recipes and input asked for) and the fork runs in this process as under the
``djflow`` fixture (``config.inprocess``): the engine's own planner, applier and kinds, no
broker, a virtual clock that starts when the run did and jumps to each timer.

The outside world is answered from the recording (:class:`Recording`): a model call whose
model and prompt equal a recorded call of the same step gets that call's reply and usage (an
error recorded is raised again, so a retry replays too); an ``mcp_tool``, ``http``, ``task``
or ``agent`` attempt whose input equals a recorded attempt's gets its output (or its error).
An approval that waits is decided as it was (by each approver in turn until the request
closes); a ``wait_event`` gets the recorded event. A call with no equal recording is made for
real with ``--live``; otherwise its step fails with class ``unrecorded`` and the replay ends
with exit 2, naming the step and the difference.

Exit codes: 0 the run's output is the recorded one; 1 it differs; 2 a call had no recording
(without ``--live``); 3 the replay could not be made (a file that is no export, a run that had
not ended, a bad ``--document``, ``--recipe`` or ``--input``).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, overload
from unittest import mock

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.core.management import call_command
from django.db import IntegrityError, connections, transaction
from django.db.migrations.loader import MigrationLoader
from django.utils.dateparse import parse_datetime

from config import metrics_files
from config.inprocess import Djflow, Run, installed
from runs import export, forks
from runs.engine import timers
from runs.models import Content, ModelCall, StepRun, Timer, ToolCall
from runs.models import Run as RunRow
from runs.status import RUN_TERMINAL
from runs.tracing import current_attempt
from workers import providers
from workflows import preflight, secrets
from workflows.errors import EngineError
from workflows.failures import KindFailure
from workflows.models import Recipe, Workflow, WorkflowVersion

EXIT_SAME, EXIT_DIFFERENT, EXIT_UNRECORDED, EXIT_UNUSABLE = 0, 1, 2, 3
FORMAT = "djflow-run-export"
FORMAT_VERSIONS = frozenset({1})
UNRECORDED = "unrecorded"
# What a difference shows at most: the start of a unified diff of the two requests.
DIFF_CHARS = 4_000
# A guard against a run that never stops waking up (a loop of sleeps the document bounds
# anyway): the replay stops after this many jumps of the clock.
MAX_JUMPS = 100_000
# Answered from the recording at the attempt: its input in, its output (or error) out.
ATTEMPT_KINDS = frozenset({"task", "agent", "mcp_tool", "http"})


class Unusable(Exception):
    """The replay cannot be made (exit 3)."""


@dataclass
class Options:
    document: Path | None = None
    # NAME=VERSION (a version in the export) or NAME=FILE (a recipe document).
    recipes: list[str] = field(default_factory=list)
    input: Any = None
    input_given: bool = False
    from_step: str | None = None
    live: bool = False
    # Seconds of real time the replay may take (the clock's jumps included).
    timeout: float = 300.0


@dataclass
class Miss:
    """A call the recording has no equal of."""

    step: str
    what: str
    difference: str

    def as_json(self) -> dict[str, str]:
        return {"step": self.step, "call": self.what, "difference": self.difference}


@dataclass
class Exchange:
    request: Any
    # ("ok", value) or (error class, message); for a model call, the recorded call.
    status: str
    answer: Any
    call: Mapping[str, Any] | None = None
    used: bool = False


def read_export(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise Unusable(f"{path}: not a readable JSON file ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise Unusable(f"{path}: not a run export (its format is not '{FORMAT}')")
    if data.get("format_version") not in FORMAT_VERSIONS:
        raise Unusable(
            f"{path}: format_version {data.get('format_version')!r} is not one this djflow "
            f"reads ({', '.join(map(str, sorted(FORMAT_VERSIONS)))})"
        )
    return data


# --- the private database ---------------------------------------------------------------------


def _migrations_key() -> str:
    """What the template's schema depends on: every app's applied migrations."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    names = sorted(f"{app}.{name}" for app, name in loader.disk_migrations)
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


@contextlib.contextmanager
def private_database() -> Iterator[Path]:
    """This process's default database switched to a fresh SQLite copy of the migrated
    template, and back when the block ends (the copy deleted). Nothing reaches the
    deployment's database in between."""
    saved = connections.settings["default"]
    connections["default"].close()
    folder = Path(settings.VAR_DIR) / "replay"
    folder.mkdir(parents=True, exist_ok=True)
    template = folder / f"template-{_migrations_key()}.sqlite3"
    with tempfile.TemporaryDirectory(prefix="djflow-replay-") as scratch:
        copy = Path(scratch) / "replay.sqlite3"
        # What the replayed run counts goes to the scratch folder, never to the
        # deployment's metric files (a scrape would count the replay as a run). The command
        # counts in memory anyway (config.settings); this holds for a caller whose metric
        # files are not open yet.
        metrics = Path(scratch) / "metrics"
        metrics.mkdir()
        counted = os.environ.get(metrics_files.ENV)
        os.environ[metrics_files.ENV] = str(metrics)
        try:
            if template.exists():
                shutil.copyfile(template, copy)
                _switch(_sqlite(saved, copy))
            else:
                _switch(_sqlite(saved, copy))
                call_command("migrate", verbosity=0, interactive=False)
                connections["default"].close()
                # Kept for the next replay: written aside, then moved into place whole.
                building = folder / f".{template.name}.{id(copy)}"
                shutil.copyfile(copy, building)
                building.replace(template)
            yield copy
        finally:
            connections["default"].close()
            _switch(saved)
            if counted is None:
                os.environ.pop(metrics_files.ENV, None)
            else:
                os.environ[metrics_files.ENV] = counted


def _sqlite(base: Mapping[str, Any], path: Path) -> dict[str, Any]:
    return {
        **base,
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(path),
        "USER": "",
        "PASSWORD": "",
        "HOST": "",
        "PORT": "",
        # A scratch database, deleted when the replay ends: no write waits for the disk
        # (a commit's fsync was a fifth of a 100-step replay).
        "OPTIONS": {"init_command": "PRAGMA synchronous=OFF; PRAGMA journal_mode=MEMORY;"},
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False,
    }


def _switch(database: Mapping[str, Any]) -> None:
    connections.settings["default"] = dict(database)
    # The next use makes a connection of the new settings (its backend class too).
    with contextlib.suppress(AttributeError):
        del connections["default"]


# --- the export into the private database -------------------------------------------------------


@transaction.atomic
def load(data: Mapping[str, Any]) -> RunRow:
    """The export's documents, recipes and runs as rows, in one transaction; returns the
    exported run."""
    for entry in data.get("documents") or []:
        Workflow.objects.get_or_create(id=entry["workflow"])
        WorkflowVersion.objects.create(
            workflow_id=entry["workflow"],
            number=entry["version"],
            document=entry["document"],
            content_hash=entry["content_hash"],
        )
    for entry in data.get("recipes") or []:
        Recipe.objects.create(
            name=entry["name"],
            version=entry["version"],
            document=entry["document"],
            content_hash=entry["content_hash"],
        )
    return _load_run(data["run"], parent_step=None, root=None, depth=0)


# What the export wrote (runs.export), read back: times parsed, ids given by the rows.
RUN_TIMES = ("created_at", "started_at", "finished_at", "deadline_at")
RUN_FIELDS = tuple(f for f in export.RUN_FIELDS if f != "id" and f not in RUN_TIMES)
STEP_TIMES = ("scheduled_at", "started_at", "finished_at")
# An attempt's error is written apart from its other fields (its traceback for operators).
STEP_FIELDS = (*(f for f in export.STEP_FIELDS if f != "id" and f not in STEP_TIMES), "error")


def _time(value: Any) -> datetime | None:
    return parse_datetime(value) if isinstance(value, str) else None


def _load_run(entry: Mapping[str, Any], *, parent_step: Any, root: Any, depth: int) -> RunRow:
    version = WorkflowVersion.objects.get(workflow_id=entry["workflow"], number=entry["version"])
    run = RunRow.objects.create(
        id=entry["id"],
        workflow_id=entry["workflow"],
        version=version,
        parent_run_id=parent_step.run_id if parent_step is not None else None,
        parent_step_run=parent_step,
        root_run_id=root,
        depth=depth,
        **{name: entry.get(name) for name in RUN_FIELDS if entry.get(name) is not None},
        **{name: _time(entry.get(name)) for name in RUN_TIMES if entry.get(name)},
    )
    # In bulk: a 100-step run's rows one INSERT at a time were a quarter of its replay.
    rows = entry.get("steps") or []
    made = StepRun.objects.bulk_create(
        StepRun(
            id=row["id"],
            run=run,
            **{name: row.get(name) for name in STEP_FIELDS if row.get(name) is not None},
            **{name: _time(row.get(name)) for name in STEP_TIMES if row.get(name)},
        )
        for row in rows
    )
    steps: dict[int, StepRun] = {step.id: step for step in made}
    contents: dict[str, Content] = {}
    calls: list[ModelCall] = []
    uses: list[ToolCall] = []
    for row in rows:
        step = steps[row["id"]]
        for call in row.get("model_calls") or []:
            calls.append(
                ModelCall(
                    step_run=step,
                    run=run,
                    prompt=_content(contents, call.get("prompt_digest"), call.get("prompt") or {}),
                    reply=_content(contents, call.get("reply_digest"), call.get("reply")),
                    **{
                        name: call[name] for name in MODEL_CALL_FIELDS if call.get(name) is not None
                    },
                )
            )
        for use in row.get("tool_calls") or []:
            uses.append(
                ToolCall(
                    step_run=step,
                    run=run,
                    arguments=_content(
                        contents, use.get("arguments_digest"), use.get("arguments") or {}
                    ),
                    result=_content(contents, use.get("result_digest"), use.get("result")),
                    **{name: use[name] for name in TOOL_CALL_FIELDS if use.get(name) is not None},
                )
            )
    Content.objects.bulk_create(contents.values(), ignore_conflicts=True)
    ModelCall.objects.bulk_create(calls)
    ToolCall.objects.bulk_create(uses)
    for child in entry.get("children") or []:
        parent = child.get("parent") or {}
        below = next(
            (
                step
                for step in reversed(steps.values())
                if step.step_id == parent.get("step") and step.kind in ("subworkflow", "foreach")
            ),
            None,
        )
        _load_run(child, parent_step=below, root=root or run.id, depth=depth + 1)
    return run


MODEL_CALL_FIELDS = tuple(f for f in export.MODEL_CALL_FIELDS if f not in ("id", "created_at"))
TOOL_CALL_FIELDS = tuple(f for f in export.TOOL_CALL_FIELDS if f not in ("id", "created_at"))


@overload
def _content(found: dict[str, Content], digest: Any, body: dict[str, Any]) -> Content: ...
@overload
def _content(found: dict[str, Content], digest: Any, body: Any) -> Content | None: ...
def _content(found: dict[str, Content], digest: Any, body: Any) -> Content | None:
    """A stored body by its digest (made once; saved with the others in bulk)."""
    if body is None:
        return None
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    key = (
        digest if isinstance(digest, str) and digest else hashlib.sha256(text.encode()).hexdigest()
    )
    if key not in found:
        found[key] = Content(digest=key, body=body, size=len(text.encode()))
    return found[key]


# --- the recording ------------------------------------------------------------------------------


class Recording:
    """Every recorded exchange of the export, by (workflow, step id), oldest first."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.models: dict[tuple[str, str], list[Exchange]] = defaultdict(list)
        self.attempts: dict[tuple[str, str], list[Exchange]] = defaultdict(list)
        self.waits: dict[tuple[str, str], list[Exchange]] = defaultdict(list)
        self._add(data["run"])

    def _add(self, run: Mapping[str, Any]) -> None:
        workflow = run["workflow"]
        for row in run.get("steps") or []:
            key = (workflow, row["step_id"])
            for call in row.get("model_calls") or []:
                request = model_request(call["provider"], call["model"], call.get("prompt"))
                reply = call.get("reply") or {}
                status = call.get("status") or "ok"
                message = (call.get("error") or {}).get("message", status)
                answer = reply.get("text") if status == "ok" else message
                self.models[key].append(Exchange(request, status, answer, call=call))
            if row["kind"] in ATTEMPT_KINDS and row["status"] in ("succeeded", "failed"):
                error = row.get("error") or {}
                status = "ok" if row["status"] == "succeeded" else error.get("class", "fatal")
                answer = row.get("output") if status == "ok" else error.get("message", "")
                self.attempts[key].append(Exchange(row.get("input"), status, answer))
            if row["kind"] in ("approval", "wait_event") and row["status"] != "waiting":
                self.waits[key].append(Exchange(row.get("input"), row["status"], row))
        for child in run.get("children") or []:
            self._add(child)

    def take(self, table: dict[tuple[str, str], list[Exchange]], key: Any, request: Any) -> Any:
        """The first unused exchange of ``key`` whose request equals ``request``; else a
        :class:`Miss`-making difference (the nearest recorded request, or none)."""
        recorded = table.get(key, [])
        for exchange in recorded:
            if not exchange.used and exchange.request == request:
                exchange.used = True
                return exchange
        # Used ones answer again (a step the fork runs twice where the run ran it once).
        for exchange in recorded:
            if exchange.request == request:
                return exchange
        if not recorded:
            return "no call of this step is recorded"
        return difference(recorded[0].request, request)


def model_request(provider: str, model: str, prompt: Any) -> dict[str, Any]:
    return {"model": f"{provider}:{model}", "prompt": prompt}


def difference(recorded: Any, asked: Any) -> str:
    lines = difflib.unified_diff(
        _pretty(recorded).splitlines(),
        _pretty(asked).splitlines(),
        "recorded",
        "replayed",
        lineterm="",
    )
    text = "\n".join(lines)
    return text if len(text) <= DIFF_CHARS else text[:DIFF_CHARS] + "\n… (cut)"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


# --- the engine's answers ----------------------------------------------------------------------


class Replayer(Djflow):
    """The ``djflow`` fixture's engine, answering from a :class:`Recording` instead of stubs
    (and for real with ``live``)."""

    recording: Recording
    live: bool = False

    def __init__(self, traveller: Any) -> None:
        super().__init__(traveller)
        self.misses: list[Miss] = []
        self.live_calls: list[str] = []
        self._workflows: dict[str, str] = {}
        self._real: dict[str, Callable[..., Any]] = {}

    def arm(self, recording: Recording, *, live: bool, real: dict[str, Callable[..., Any]]) -> None:
        self.recording, self.live, self._real = recording, live, real

    def _key(self) -> tuple[str, str]:
        attempt = current_attempt.get()
        if attempt is None:
            raise RuntimeError("a call outside an attempt")
        run_id = attempt.run_id
        if run_id not in self._workflows:
            self._workflows[run_id] = RunRow.objects.values_list("workflow_id", flat=True).get(
                id=run_id
            )
        return self._workflows[run_id], attempt.step_id

    def _missed(self, key: tuple[str, str], what: str, why: str) -> None:
        step = f"{key[0]}.{key[1]}"
        if self.live:
            self.live_calls.append(f"{step}: {what}")
            return
        self.misses.append(Miss(step, what, why))
        raise KindFailure(
            f"{what}: no recorded call equals it (run_replay --live makes it for real)",
            UNRECORDED,
        )

    def _model_call(self, name: str, request: providers.ModelRequest) -> providers.ModelReply:
        key = self._key()
        provider, _ = providers.split_model(name)
        # Compared as the export shows a prompt: the run's secrets (in hand while the attempt
        # runs) masked, as they were masked in the recording.
        asked = secrets.scrub(
            model_request(
                provider, request.model, {"system": request.system, "messages": request.messages}
            )
        )
        found = self.recording.take(self.recording.models, key, asked)
        if isinstance(found, str):
            self._missed(key, f"model call to {name}", found)
            reply: providers.ModelReply = self._real["model"](name, request)
            return reply
        call = found.call or {}
        if found.status != "ok":
            raise providers.ModelError(str(found.answer), error_class=found.status)
        return providers.ModelReply(
            text=str(found.answer or ""),
            model=call.get("answered_by") or request.model,
            input_tokens=int(call.get("input_tokens") or 0),
            output_tokens=int(call.get("output_tokens") or 0),
            cached_tokens=call.get("cached_tokens"),
            reasoning_tokens=call.get("reasoning_tokens"),
            stop_reason="end_turn",
            request_id=call.get("request_id") or "",
        )

    def _attempt(self, what: str, ctx: Any, given: Any, real: Callable[[], Any]) -> Any:
        key = self._key()
        # Compared as the export shows an attempt's input: the run's secrets as tokens
        # (as stored), then masked (as exported).
        shown = secrets.shown(ctx.conceal(given))
        found = self.recording.take(self.recording.attempts, key, shown)
        if isinstance(found, str):
            self._missed(key, what, found)
            return real()
        if found.status != "ok":
            # The class the attempt failed with; one only the engine assigns (a time-out, a
            # lost worker) fails it as retryable, which the step's policy retries alike.
            known = found.status in KindFailure._classes
            message = str(found.answer) if known else f"{found.status}: {found.answer}"
            raise KindFailure(message, found.status if known else "retryable")
        return found.answer

    def _tool_call(self, ctx: Any, given: Any, prior: Any = None) -> Any:
        what = f"mcp_tool {given.get('server')}.{given.get('tool')}"
        return self._attempt(what, ctx, given, lambda: self._real["tool"](ctx, given, prior))

    def _http_call(self, ctx: Any, given: Any, prior: Any = None) -> Any:
        what = f"http {given.get('method', 'GET')} {given.get('url')}"
        return self._attempt(what, ctx, given, lambda: self._real["http"](ctx, given, prior))

    def lookup_with(self, lookup: Callable[..., Any]) -> Callable[..., Any]:
        """Every task and agent body is answered from the recording (the handler runs only
        for a call with no recording, under ``live``)."""

        def found(workflow_id: str, step_id: str, handler_name: str | None = None) -> Any:
            handler = lookup(workflow_id, step_id, handler_name)

            def recorded(ctx: Any, given: Any, prior: Any = None) -> Any:
                def real() -> Any:
                    if handler is None:
                        raise KindFailure(
                            f"handler of {workflow_id}.{step_id}: not registered in this "
                            "process (WORKFLOW_MODULES)",
                            UNRECORDED,
                        )
                    return handler(ctx, given, prior)

                return self._attempt(f"handler of step {step_id}", ctx, given, real)

            return recorded

        return found


# --- the replay ---------------------------------------------------------------------------------


@dataclass
class Result:
    code: int
    source: Any
    replayed: Any
    misses: list[Miss]
    live_calls: list[str]
    status: str
    reused: list[str]


# The errors a malformed export raises while it is loaded (a field missing or of the wrong
# type, a row the database refuses): the replay is not made (exit 3), never a traceback.
MALFORMED = (
    KeyError,
    TypeError,
    ValueError,
    AttributeError,
    IntegrityError,
    ValidationError,
    ObjectDoesNotExist,
)


def replay(data: Mapping[str, Any], options: Options) -> Result:
    """Replay the export (see the module); run inside :func:`private_database`."""
    _check_documents(data)
    try:
        source = load(data)
    except MALFORMED as error:
        raise Unusable(f"the export is malformed: {type(error).__name__}: {error}") from None
    if source.status not in RUN_TERMINAL:
        raise Unusable(f"run {source.id} had not ended when it was exported ({source.status})")
    document = _document(options.document)
    pins = _recipes(options.recipes)
    recording = Recording(data)
    if options.live:
        # The handlers a live call runs, as a worker imports them.
        for module in settings.WORKFLOW_MODULES:
            importlib.import_module(module)
    _approvers(data.get("documents") or [])
    start = source.created_at
    # Taken before the fixture replaces them (after, they would be its own answers).
    real = _real_calls()
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(installed(engine=Replayer, start=start))
        assert isinstance(engine, Replayer)
        engine.arm(recording, live=options.live, real=real)
        if not options.input_given:
            # The run's own input was checked when it started; the export shows its secrets
            # as ••••, which a secret's type or pattern would refuse now.
            for module in (forks, preflight):
                stack.enter_context(mock.patch.object(module, "input_errors", _no_errors))
        try:
            with engine._settling():
                fork = forks.run_fork(
                    run_id=source.id,
                    from_step=options.from_step,
                    document=document,
                    recipes=pins or None,
                    input=options.input if options.input_given else None,
                )
        except EngineError as error:
            raise Unusable(_problems(error)) from None
        _drive(engine, fork.id, deadline=time.monotonic() + options.timeout)
        row = RunRow.objects.get(id=fork.id)
    if engine.misses:
        code = EXIT_UNRECORDED
    else:
        code = EXIT_SAME if row.output == source.output else EXIT_DIFFERENT
    return Result(
        code=code,
        source=source,
        replayed=row,
        misses=engine.misses,
        live_calls=engine.live_calls,
        status=row.status,
        reused=list(getattr(fork, "reused", [])),
    )


def _no_errors(*args: Any, **kwargs: Any) -> list[Any]:
    return []


def _check_documents(data: Mapping[str, Any]) -> None:
    """Each document of the export passes the checks of a save (its bounds among them: a
    crafted loop of 10^8 iterations would replay for hours), or the replay is not made."""
    from workflows.validation import validate_document

    entries = data.get("documents")
    if not isinstance(entries, list) or not entries:
        raise Unusable("the export is malformed: it holds no documents")
    held = {entry.get("workflow") for entry in entries if isinstance(entry, dict)}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("document"), dict):
            raise Unusable(f"the export is malformed: documents[{index}] is no document")
        problems = validate_document(
            entry["document"],
            workflow_exists=lambda workflow, version: workflow in held,
            max_steps=settings.DJFLOW["MAX_DOCUMENT_STEPS"],
        )
        if problems:
            named = "; ".join(f"{e.field}: {e.message}" if e.field else e.message for e in problems)
            raise Unusable(f"documents[{index}] would not be saved here: {named}")


def _approvers(documents: list[Mapping[str, Any]]) -> None:
    """The users and groups the documents' approval steps name, made in the private database
    (each group with one member): the approvals open as they did, and are decided by them."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    people = get_user_model()
    for entry in documents:
        for step in _steps(entry["document"].get("steps") or []):
            if step.get("kind") != "approval":
                continue
            for spec in (step.get("approvers") or {}, step.get("escalate_to") or {}):
                for name in spec.get("users") or []:
                    people.objects.get_or_create(username=name)
                for name in spec.get("groups") or []:
                    group, made = Group.objects.get_or_create(name=name)
                    if made:
                        member, _ = people.objects.get_or_create(username=f"replay-{name}")
                        member.groups.add(group)


def _steps(body: Any) -> Iterator[Mapping[str, Any]]:
    for step in body if isinstance(body, list) else [body]:
        if not isinstance(step, Mapping):
            continue
        yield step
        for name in ("then", "else", "do"):
            if name in step:
                yield from _steps(step[name])
        for branch in (step.get("branches") or {}).values():
            yield from _steps(branch)


def _problems(error: EngineError) -> str:
    errors = getattr(error, "errors", None) or []
    named = [f"{e.field}: {e.message}" if e.field else e.message for e in errors]
    return "; ".join(named) or str(error)


def _real_calls() -> dict[str, Callable[..., Any]]:
    """The calls as the engine makes them, before the fixture replaced them."""
    from workers.kinds import http, mcp_tool

    return {"model": providers.call, "tool": mcp_tool.call, "http": http.call}


def _document(path: Path | None) -> int | None:
    """``--document``: saved as the workflow's next version (in the private database),
    whatever ``version`` it says."""
    if path is None:
        return None
    from workflows.services import definition_save

    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise Unusable(f"--document {path}: not a readable JSON file ({error})") from None
    if isinstance(document, dict):
        # An edit of the export's document carries the version it was: saved as the next.
        document = {key: value for key, value in document.items() if key != "version"}
    try:
        return int(definition_save(document=document).version.number)
    except EngineError as error:
        raise Unusable(f"--document {path}: {_problems(error)}") from None


def _recipes(given: list[str]) -> dict[str, int]:
    """``--recipe NAME=VERSION`` (a version in the export) or ``NAME=FILE`` (a recipe
    document, saved as the recipe's next version in the private database)."""
    from workflows.services import recipe_save

    pins: dict[str, int] = {}
    for entry in given:
        name, sep, value = entry.partition("=")
        if not sep or not name:
            raise Unusable(f"--recipe {entry}: give NAME=VERSION or NAME=FILE")
        if value.isdigit():
            if Recipe.objects.resolve(name, int(value)) is None:
                there = sorted(Recipe.objects.filter(name=name).values_list("version", flat=True))
                raise Unusable(
                    f"--recipe {entry}: the export holds no version {value} of recipe '{name}' "
                    f"(it holds {there or 'none'}); give the recipe's document as a file"
                )
            pins[name] = int(value)
            continue
        try:
            document = json.loads(Path(value).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise Unusable(f"--recipe {entry}: not a readable JSON file ({error})") from None
        if isinstance(document, dict):
            document = {**document, "name": name}
            document.pop("version", None)
        try:
            recipe, _ = recipe_save(document=document)
        except EngineError as error:
            raise Unusable(f"--recipe {entry}: {_problems(error)}") from None
        pins[name] = recipe.version
    return pins


def _drive(engine: Replayer, run_id: Any, *, deadline: float) -> None:
    """Until the run ends: decide what waits on people as the recording did, else move the
    clock to the next timer. Stops when neither moves it (it waits on something the
    recording does not hold); past ``deadline`` (``time.monotonic``), the replay is not made."""
    for _ in range(MAX_JUMPS):
        if time.monotonic() > deadline:
            raise Unusable("the replay was still running at its time limit (--timeout)")
        run = RunRow.objects.get(id=run_id)
        if run.status in RUN_TERMINAL:
            return
        if _answer_waits(engine, run_id):
            continue
        due = (
            Timer.objects.filter(fired_at__isnull=True)
            .order_by("fire_at")
            .values_list("fire_at", flat=True)
            .first()
        )
        if due is None:
            return
        engine._clock.move_to(due)
        with engine._settling():
            timers.fire_due(budget_seconds=60.0)


def _answer_waits(engine: Replayer, run_id: Any) -> bool:
    """Decide the approvals and deliver the events the fork's tree waits for, each as the
    recording says it went; True when one was."""
    from approvals.models import ApprovalRequest
    from approvals.services import Origin, approval_decide

    tree = RunRow.objects.filter(root_run_id=run_id) | RunRow.objects.filter(id=run_id)
    waiting = StepRun.objects.filter(
        run__in=tree, status="waiting", kind__in=("approval", "wait_event")
    ).select_related("run")
    moved = False
    for row in waiting:
        key = (row.run.workflow_id, row.step_id)
        exchanges = engine.recording.waits.get(key, [])
        recorded = next((e for e in exchanges if not e.used), None)
        if recorded is None:
            if not any(miss.step == f"{key[0]}.{key[1]}" for miss in engine.misses):
                engine.misses.append(
                    Miss(f"{key[0]}.{key[1]}", row.kind, "no recorded decision or event")
                )
            continue
        outcome = recorded.answer
        if outcome["status"] == "timed_out":
            continue  # the clock will time it out as it did
        recorded.used = True
        moved = True
        if row.kind == "wait_event":
            waits_for = row.input or {}
            engine.send_event(waits_for["event"], waits_for["key"], outcome.get("output"))
            continue
        request = ApprovalRequest.objects.filter(step_run=row).order_by("-id").first()
        if request is None:
            continue
        decision = "approved" if outcome["status"] == "succeeded" else "rejected"
        said = outcome.get("output") if isinstance(outcome.get("output"), dict) else {}
        comment = str(said.get("comment") or "")
        for person in request.people.select_related("user").order_by("id"):
            with engine._settling():
                approval_decide(
                    request_id=request.id,
                    decision=decision,
                    comment=comment,
                    origin=Origin("link"),
                    user=person.user,
                    approver_id=person.id,
                )
            if StepRun.objects.get(id=row.id).status != "waiting":
                break
    return moved


def run_of(result: Result) -> Run:
    return Run(result.replayed)
