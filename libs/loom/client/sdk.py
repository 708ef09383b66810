"""Client of a running Loom: submit, watch, query."""

import asyncio
import contextlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import msgspec
import nats.errors
import yaml
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.api import PubAck
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from loom import security
from loom.bus import Publisher, connect
from loom.bus.connection import BusError, credentials_path, identity_at, publish_denied
from loom.errors import InvalidInputError, LoomError
from loom_proto import subjects
from loom_proto.codec import DecodeError, decode
from loom_proto.ids import plain_words
from loom_proto.jobs import (
    JOB_STATES,
    TERMINAL_STATES,
    JobCancelled,
    JobEvent,
    JobRejected,
    JobSpec,
    JobSubmitted,
    nul_text,
)
from loom_proto.view import ViewQuery

_tracer = trace.get_tracer("loom.client")


class SpecError(InvalidInputError):
    """A job spec that cannot be submitted; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What became of a submission (:meth:`LoomClient.submit_checked`).

    ``outcome``: ``accepted`` (placement stored it; ``state`` says where it is), ``rejected``
    (``code``, ``reason``, ``hint``), ``duplicate`` (the same spec was submitted before),
    ``conflict`` (the id is taken by a different spec), or ``unanswered`` (stored on the bus, but
    placement did not answer in time: it will be decided when placement runs)."""

    job_id: str
    outcome: str
    state: str = ""
    code: str = ""
    reason: str = ""
    hint: str = ""
    trace_id: str | None = None
    """The trace the submission started (None when the caller records no spans)."""


class QueryError(LoomError):
    """A query the service could not answer."""


class SubmissionUnsure(BusError):
    """A submission whose publish got no ack: it may have been stored. Retry it under
    :attr:`msg_id` (``submit(spec, msg_id=...)``): JetStream keeps one copy; under a new id a stored
    one comes back ``rejected`` as a duplicate."""

    def __init__(self, message: str, *, msg_id: str) -> None:
        super().__init__(message)
        self.msg_id = msg_id


class RefusedQueryError(QueryError, InvalidInputError):
    """A query the service refused as the asker's fault (``"invalid": true`` in its answer: an
    unknown region, a malformed request); the CLI exits 2 for it, as for other bad input."""


def _whole_characters(value: Any, path: str = "$") -> Any:
    """``value`` with each UTF-16 surrogate pair in its texts (keys too) made the one character it
    stands for; a lone surrogate is refused (:class:`SpecError`, naming where). YAML reads the JSON
    escape ``"\\ud83d\\ude80"`` (how Python's ``json.dump`` writes an emoji) as two surrogates,
    which cannot be encoded: ``loom submit`` failed with a traceback on such a file."""
    if isinstance(value, str):
        if not any("\ud800" <= ch <= "\udfff" for ch in value):
            return value
        try:
            return value.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            raise SpecError(f"{path} holds a lone UTF-16 surrogate (half of a character)") from None
    if isinstance(value, dict):
        return {_whole_characters(k, path): _whole_characters(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_characters(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def spec_from_mapping(raw: Mapping[str, Any], *, default_tenant: str | None = None) -> JobSpec:
    """Validate one job spec; a missing ``job_id`` becomes ``<name or 'job'>-<random>``."""
    try:
        # Fast: a text holding a surrogate is refused by the encoder (~1 us a spec, the walk
        # below ~40 us); anything it cannot encode (a surrogate, a key or value of another type)
        # goes the walk's way, which raises as before for what is not a spec.
        msgspec.json.encode(raw)
        data = dict(raw)
    except (ValueError, TypeError, OverflowError, msgspec.EncodeError):
        try:
            data = dict(_whole_characters(dict(raw)))
        except SpecError as exc:
            raise SpecError(f"job spec {raw.get('job_id')!r}: {exc}") from None
    if "job_id" not in data:
        # The name as an id: every run of characters an id may not hold becomes one '-'.
        base = re.sub(r"[^A-Za-z0-9_-]+", "-", str(data.get("name") or "")).strip("-")[:40] or "job"
        data["job_id"] = f"{base}-{secrets.token_hex(4)}"
    if "tenant" not in data and default_tenant:
        data["tenant"] = default_tenant
    try:
        spec = msgspec.convert(data, JobSpec)
    except msgspec.ValidationError as exc:
        raise SpecError(f"job spec {data.get('job_id')!r}: {plain_words(str(exc))}") from exc
    if (where := nul_text(spec)) is not None:
        raise SpecError(
            f"job spec {spec.job_id!r}: {where} holds a NUL character, which stored text cannot hold"
        )
    return spec


_EVENT_TYPES: dict[str, type] = {t.__struct_config__.tag: t for t in get_args(JobEvent)}
"""Each job event's type by its kind (the ``kind`` tag, and the subject's third token)."""


def _event_of(msg: Msg) -> JobEvent | None:
    """A job event off the bus, or None for what is not one. A payload without ``kind`` (placement
    accepts a submission so) is read as the kind its subject names."""
    try:
        event: JobEvent = decode(msg.data, JobEvent)  # type: ignore[arg-type]
        return event
    except DecodeError:
        kind = msg.subject.split(".")[2] if msg.subject.count(".") >= 3 else ""
        typed = _EVENT_TYPES.get(kind)
        if typed is None:
            return None
        try:
            found: JobEvent = decode(msg.data, typed)
            return found
        except DecodeError:
            return None


def checked_spec(spec: JobSpec | Mapping[str, Any], *, default_tenant: str | None = None) -> JobSpec:
    """``spec`` checked against every constraint of :class:`JobSpec` (a Struct built in code is
    not: ``Work(steps=0)`` constructs), or a mapping read by :func:`spec_from_mapping`; raises
    :class:`SpecError` naming the field."""
    if isinstance(spec, JobSpec):  # a JobSubmitted too: its own fields are not a spec's
        fields = msgspec.to_builtins(spec)
        return spec_from_mapping({f: fields[f] for f in JobSpec.__struct_fields__ if f in fields})
    if isinstance(spec, Mapping):  # the raw event's "kind" (the README's example) is no spec field
        fields = {k: v for k, v in spec.items() if not (k == "kind" and v == "submitted")}
        return spec_from_mapping(fields, default_tenant=default_tenant)
    raise SpecError(f"a job spec is a JobSpec or a mapping of its fields, not {type(spec).__name__}")


def load_specs(path: str | Path, *, default_tenant: str | None = None) -> list[JobSpec]:
    """Read a YAML or JSON file holding one job, a list of jobs, or ``{jobs: [...]}``."""
    text = Path(path).read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:  # its own words name '<unicode string>': the file is named here
        said = str(exc).replace('in "<unicode string>", ', "at ")
        raise SpecError(f"{path}: not valid YAML or JSON: {said}") from exc
    if isinstance(raw, dict) and "jobs" in raw:
        raw = raw["jobs"]
    items = raw if isinstance(raw, list) else [raw]
    if not items or not all(isinstance(i, dict) for i in items):
        raise SpecError(f"{path}: expected a job mapping, a list of them, or {{jobs: [...]}}")
    specs = []
    for n, item in enumerate(items, 1):
        try:
            specs.append(spec_from_mapping(item, default_tenant=default_tenant))
        except SpecError as exc:  # which file, and which of its jobs
            where = f"{path}: job {n} of {len(items)}" if len(items) > 1 else str(path)
            raise SpecError(f"{where}: {exc}") from None
    seen: set[str] = set()
    for spec in specs:
        if spec.job_id in seen:  # the second would be refused as "taken by a different spec"
            raise SpecError(f"{path}: job id {spec.job_id!r} is given twice; each job needs its own")
        seen.add(spec.job_id)
    return specs


class LoomClient:
    """A connection to Loom over NATS."""

    def __init__(self, nc: Client, *, identity: str | None = None) -> None:
        self.nc = nc
        self.publisher = Publisher(nc)
        self.identity = identity
        """The NATS identity it connected as (``tenant-acme``, ``admin``), None when unsecured."""

    @classmethod
    async def connect(
        cls, nats_url: str, *, name: str = "loom-client", first_within_s: float | None = None
    ) -> "LoomClient":
        """Connect to the NATS server of a Loom deployment; with ``first_within_s``, raise
        :class:`~loom.bus.connection.BusError` (saying to start the stack) when no server answers
        by then, instead of waiting for one."""
        identity = identity_at(nats_url)
        creds = credentials_path(nats_url)
        return cls(
            await connect(nats_url, name, first_within_s=first_within_s, creds=creds), identity=identity
        )

    @property
    def _jobs_query(self) -> str:
        """Where job queries go: a tenant's identity asks on its own subject (its jobs only)."""
        tenant = security.tenant_of(self.identity)
        return subjects.JOBS_QUERY if tenant is None else subjects.jobs_query(tenant)

    async def close(self) -> None:
        """Flush and close the connection; closing again does nothing (it raised)."""
        if self.nc.is_closed or self.nc.is_draining:
            return
        await self.nc.drain()

    async def submit(self, spec: JobSpec | Mapping[str, Any], *, msg_id: str | None = None) -> str:
        """Submit a job (a :class:`JobSpec` or a mapping of its fields, checked as
        :func:`spec_from_mapping` checks it: a :class:`SpecError` and nothing sent when it is not
        valid). Resubmitting a ``job_id`` placement holds changes nothing: placement answers it
        ``rejected`` with code ``duplicate`` and keeps the job (:meth:`submit_checked` looks first
        and sends nothing). ``msg_id``: the message id to send it under, for a caller that retries a
        submission it is not sure landed (the same id again: JetStream keeps one copy); by default
        one nobody can guess, new at each call."""
        spec = checked_spec(spec, default_tenant=self._own_tenant())  # a tenant's own, unless given
        await self._publish_submission(spec, msg_id=msg_id)
        return spec.job_id

    async def _publish_submission(
        self, spec: JobSpec, *, msg_id: str | None = None
    ) -> tuple[PubAck, str | None]:
        """Publish one submission under a ``loom submit`` span, the root of the job's trace when
        the caller set up telemetry (the CLI does); returns the ack and the trace id."""
        fields = {f: getattr(spec, f) for f in JobSpec.__struct_fields__}
        job = JobSubmitted(**fields, submitted_at=time.time())
        with _tracer.start_as_current_span(
            "loom submit",
            kind=SpanKind.CLIENT,
            attributes={"loom.job_id": spec.job_id, "loom.tenant": spec.tenant},
        ) as span:
            # A message id nobody can guess: JetStream drops a message whose id it saw in the last
            # two minutes, whoever sent it, so a predictable id (the job id) could be taken first by
            # another tenant and this submission dropped as its duplicate. Retries of this publish
            # reuse it; a second submission is a new message (placement knows the job id).
            msg_id = msg_id or f"{spec.job_id}:{secrets.token_hex(8)}"
            try:
                ack = await self.publisher.publish(subjects.job_submitted(spec.tenant), job, msg_id=msg_id)
            except SubmissionUnsure:
                raise
            except BusError as exc:
                if exc.non_retryable:  # refused (permissions): it was not stored
                    raise
                # No ack is no "not stored": after a 65 s NATS outage 20 submissions told "failed"
                # had been stored and ran; retried under a new id they came back "duplicate".
                raise SubmissionUnsure(
                    f"{exc}; the submission may have been stored: retry it with"
                    f" submit(spec, msg_id={msg_id!r}) (JetStream keeps one copy)",
                    msg_id=msg_id,
                ) from exc
            ctx = span.get_span_context()
        return ack, (format(ctx.trace_id, "032x") if ctx.is_valid else None)

    async def submit_checked(self, spec: JobSpec | Mapping[str, Any], *, wait_s: float = 3.0) -> Admission:
        """Submit a job and say what became of it within ``wait_s``: accepted, rejected (with the
        code, reason and hint placement gave), a duplicate of the same spec, or a conflict (the id
        is taken by another spec). The bus stays the contract: this is :meth:`submit` plus a look
        at the job's record and its ``rejected`` event."""
        spec = checked_spec(spec, default_tenant=self._own_tenant())
        try:
            existing = await self.job(spec.job_id, timeout_s=min(wait_s, 2.0))
        except QueryError:
            existing = None  # placement is not answering: the submission waits on the bus for it
        if existing is not None:
            return self._known(spec, existing)
        rejected = await self.nc.subscribe(subjects.job_event("rejected", spec.tenant))
        try:
            # A duplicate ack can only be this call's own publish retried after a lost ack (the id
            # has a random part): it was stored, so what placement makes of it is still the answer.
            _, trace_id = await self._publish_submission(spec)
            deadline = time.monotonic() + wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msg = await rejected.next_msg(timeout=min(left, 0.25))
                except Exception:  # nothing within the slice: look at the job's record instead
                    try:
                        found = await self.job(spec.job_id, timeout_s=max(min(left, 1.0), 0.1))
                    except QueryError:
                        continue
                    if found is not None:
                        return Admission(
                            spec.job_id,
                            "accepted",
                            state=str(found["state"]),
                            trace_id=trace_id,
                            reason=str(found.get("reason") or ""),  # why it ended, if it did
                        )
                    continue
                try:
                    event = decode(msg.data, JobRejected)
                except DecodeError:
                    continue
                if event.job_id == spec.job_id:
                    if event.code == "duplicate":
                        # Its id was stored meanwhile (another `loom submit` of the same file, a
                        # retry after "unanswered"): the job itself is the answer, if it is ours.
                        with contextlib.suppress(QueryError):
                            held = await self.job(spec.job_id, timeout_s=max(min(left, 1.0), 0.1))
                            if held is not None:
                                return self._known(spec, held)
                    return Admission(
                        spec.job_id, "rejected", code=event.code, reason=event.reason, hint=event.hint
                    )
        finally:
            await rejected.unsubscribe()
        return Admission(
            spec.job_id,
            "unanswered",
            reason=f"placement did not answer within {wait_s:g} s",
            trace_id=trace_id,
        )

    @staticmethod
    def _known(spec: JobSpec, existing: Mapping[str, Any]) -> Admission:
        """A submission whose id placement already holds: the same spec, or another one."""
        stored = {k: v for k, v in dict(existing.get("spec") or {}).items() if k in JobSpec.__struct_fields__}
        try:
            same = msgspec.convert(stored, JobSpec) == spec
        except msgspec.ValidationError:
            same = False
        state = str(existing.get("state", ""))
        if same:
            return Admission(spec.job_id, "duplicate", state=state, reason="already submitted")
        return Admission(
            spec.job_id,
            "conflict",
            state=state,
            reason=f"job id {spec.job_id!r} is taken by a different spec; choose a new job id",
        )

    async def _query(self, subject: str, request: Mapping[str, Any], timeout_s: float) -> Any:
        if self.nc.is_closed:
            raise QueryError("this client is closed: connect again")  # not "the service is not running"
        asked = time.monotonic()
        data = json.dumps(request).encode()
        try:
            reply = await self._hedged(subject, data, timeout_s)
        except NoRespondersError as exc:
            raise QueryError(f"nothing listens on {subject}: is the service running?") from exc
        except Exception as exc:
            if publish_denied(self.nc, subject, since=asked):
                # Told "the service is not running, or cannot reach its database" before.
                raise QueryError(
                    f"refused: this client's NATS permissions do not allow asking {subject}"
                    f" (identity {self.identity or 'unknown'})"
                ) from exc
            raise QueryError(
                f"no answer on {subject} within {timeout_s:g} s: the service is not running, or cannot"
                f" reach its database (`loom status` says which) ({exc!r})"
            ) from exc
        body = json.loads(reply.data)
        if not body.get("ok"):
            raise (RefusedQueryError if body.get("invalid") else QueryError)(str(body.get("error")))
        return body["result"]

    async def _hedged(self, subject: str, data: bytes, timeout_s: float) -> Msg:
        """A query's answer within ``timeout_s``: asked once, and asked again at half the budget
        while the first ask waits on, whichever answers first taken. A queue group member that
        hangs (a stopped standby) takes its share of the requests and answers none: the second ask
        likely reaches another (an outside walk: half of the CLI's queries timed out with one of
        two placement instances frozen); a service that is only slow still answers the first
        (queries only read, so asking twice changes nothing)."""
        first = asyncio.ensure_future(self.nc.request(subject, data, timeout=timeout_s))
        asks = {first}
        try:
            done, _ = await asyncio.wait(asks, timeout=timeout_s / 2)
            if not done:
                asks.add(asyncio.ensure_future(self.nc.request(subject, data, timeout=timeout_s / 2)))
            error: BaseException | None = None
            while asks:
                done, asks = await asyncio.wait(asks, return_when=asyncio.FIRST_COMPLETED)
                for ask in done:
                    if ask.exception() is None:
                        return ask.result()
                    if error is None or not isinstance(ask.exception(), nats.errors.TimeoutError):
                        error = ask.exception()  # a refusal says more than a timeout
            assert error is not None
            raise error
        finally:
            for ask in asks:
                ask.cancel()

    async def job(self, job_id: str, *, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """A job with its event history, or None when placement never accepted it."""
        result: dict[str, Any] | None = await self._query(
            self._jobs_query, {"op": "get", "job_id": job_id}, timeout_s
        )
        return result

    async def cancel(self, job_id: str, *, reason: str = "", wait_s: float = 10.0) -> str:
        """Cancel a job: publish its ``cancelled`` event (the bus is the contract) and wait until
        placement has recorded it. A queued job leaves the queue; a running one is stopped on
        every cluster and gives its GPUs back; a DAG's unfinished stages go with it.

        Returns the job's state afterwards (``cancelled``, or how it had already ended). Raises
        :class:`QueryError` for an unknown job or when placement does not record it in time.
        """
        state, _ = await self.cancel_outcome(job_id, reason=reason, wait_s=wait_s)
        return state

    async def cancel_outcome(
        self, job_id: str, *, reason: str = "", wait_s: float = 10.0
    ) -> tuple[str, bool]:
        """:meth:`cancel`, and whether the job had already ended before this request (then
        nothing was sent: a job cancelled earlier is ``("cancelled", True)``)."""
        if "\x00" in reason:
            raise SpecError("a cancellation's reason cannot hold a NUL character")
        job = await self.job(job_id)
        if job is None:
            raise QueryError(f"no job {job_id!r}")
        if job["state"] in TERMINAL_STATES:
            return str(job["state"]), True
        event = JobCancelled(
            job_id=job_id,
            tenant=str(job["tenant"]),
            reason=(reason or "cancelled by request")[:1024],
            at=time.time(),
        )
        # A message id nobody can guess: a predictable one could be taken first by any tenant (its
        # cancellation refused, the id still counted in JetStream's duplicate window), and this one
        # dropped as its duplicate. Retries of this publish reuse it; a second request sends anew.
        await self.publisher.publish(
            subjects.job_event("cancelled", event.tenant),
            event,
            msg_id=f"{job_id}:cancelled:{job['attempt']}:{secrets.token_hex(8)}",
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            now = await self.job(job_id)
            if now is not None and now["state"] in TERMINAL_STATES:
                return str(now["state"]), False
            await asyncio.sleep(0.2)
        raise QueryError(f"placement did not record the cancellation of {job_id} within {wait_s:g} s")

    def _own_tenant(self) -> str | None:
        """The tenant this client's identity is (``tenant-acme`` is ``acme``), None for any other."""
        return security.tenant_of(self.identity)

    async def jobs(
        self, *, tenant: str | None = None, state: str | None = None, limit: int = 100, timeout_s: float = 5.0
    ) -> list[dict[str, Any]]:
        """Newest jobs first (a ``state`` not a job state is refused: :class:`SpecError`)."""
        if state is not None and state not in JOB_STATES:
            raise SpecError(f"unknown job state {state!r}; one of {', '.join(JOB_STATES)}")
        result: list[dict[str, Any]] = await self._query(
            self._jobs_query, {"op": "list", "tenant": tenant, "state": state, "limit": limit}, timeout_s
        )
        return result

    async def explain(self, job_id: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
        """A job and every decision record of it (``{"job": ..., "decisions": [...]}``)."""
        result: dict[str, Any] = await self._query(
            self._jobs_query, {"op": "explain", "job_id": job_id}, timeout_s
        )
        return result

    async def learned_speeds(self, *, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """What placement learned of each (job family, GPU model)'s speed: ``family``, ``gpu_model``,
        ``factor`` (times the profile's speed), ``log_sd``, ``runs`` and ``source``."""
        result: list[dict[str, Any]] = await self._query(self._jobs_query, {"op": "learned"}, timeout_s)
        return result

    async def drains(self, *, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Clusters closed to new work by ``loom drain`` (the migration service's drains):
        ``cluster``, ``state`` (``draining`` / ``drained``), ``started_at``, the drain's settings
        and the jobs ``waiting`` to move."""
        result: list[dict[str, Any]] = await self._query(subjects.MIGRATE_QUERY, {"op": "drains"}, timeout_s)
        return result

    async def counts(self, *, timeout_s: float = 5.0) -> dict[str, int]:
        """How many jobs are in each state."""
        result: dict[str, int] = await self._query(self._jobs_query, {"op": "counts"}, timeout_s)
        return result

    async def view(
        self,
        *,
        region: str | None = None,
        zone: str | None = None,
        gpu_model: str | None = None,
        min_free_gpus: int = 0,
        fresh_only: bool = False,
        nodes: bool = True,
        timeout_s: float = 5.0,
    ) -> dict[str, Any]:
        """The resource tree: region -> zone -> cluster -> node, filtered."""
        query = ViewQuery(
            region=region,
            zone=zone,
            gpu_model=gpu_model,
            min_free_gpus=min_free_gpus,
            fresh_only=fresh_only,
            nodes=nodes,
        )
        request = msgspec.structs.asdict(query)
        result: dict[str, Any] = await self._query(subjects.VIEW_QUERY, request, timeout_s)
        return result

    async def net_point(
        self,
        *,
        src: str | None = None,
        dst: str | None = None,
        region: str | None = None,
        timeout_s: float = 5.0,
    ) -> Any:
        """Link state now and forecast: one link (``src``, ``dst``), a region's links, or every link."""
        request: dict[str, Any] = {}
        if src is not None or dst is not None:
            request = {"src": src, "dst": dst}
        elif region is not None:
            request = {"region": region}
        return await self._query(subjects.NET_QUERY_POINT, request, timeout_s)

    async def net_path(self, src: str, dst: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
        """The chosen path between two regions (with hysteresis), the momentary best, and why."""
        request = {"src": src, "dst": dst}
        result: dict[str, Any] = await self._query(subjects.NET_QUERY_PATH, request, timeout_s)
        return result

    async def net_emulate(
        self, src: str, dst: str, request: Mapping[str, Any], *, timeout_s: float = 5.0
    ) -> list[dict[str, Any]]:
        """Change (``op``: degrade / restore) or show one emulated link of the local stack."""
        result: list[dict[str, Any]] = await self._query(subjects.net_emulator(src, dst), request, timeout_s)
        return result

    async def net_emulate_all(
        self, request: Mapping[str, Any], *, wait_s: float = 1.0
    ) -> list[dict[str, Any]]:
        """Send ``request`` (restore / show) to every collector; the links of all who answer in ``wait_s``."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        links: list[dict[str, Any]] = []
        try:
            await self.nc.publish(subjects.NET_EMU_ALL, json.dumps(request).encode(), reply=inbox)
            deadline = time.monotonic() + wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=left)
                except Exception:  # nothing more within the wait: every collector that could answered
                    break
                body = json.loads(msg.data)
                if not body.get("ok"):
                    raise QueryError(str(body.get("error")))
                links.extend(body["result"])
        finally:
            await sub.unsubscribe()
        return sorted(links, key=lambda link: (link["src"], link["dst"]))

    async def watch(self, tenant: str | None = None) -> AsyncIterator[tuple[str, JobEvent]]:
        """Yield (subject, event) for every job event from now on, of one tenant or all. A tenant's
        identity watches its own tenant (the default for it); another's raises :class:`QueryError`
        (nats-server refuses the subscription: the loop waited for ever, the refusal only logged)."""
        mine = self._own_tenant()
        if mine is not None:
            if tenant not in (None, mine):
                raise QueryError(f"tenant {mine!r} may watch its own jobs only, not tenant {tenant!r}'s")
            tenant = mine
        if tenant is not None:
            subjects.job_submitted(tenant)  # validates the id
        # A tenant's identity may read only its own tenant's events; two subscriptions into one
        # queue, since agents' reports carry the reporting cluster as a fifth token.
        own = tenant is not None and self.identity == f"tenant-{tenant}"
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        watched = (
            [subjects.tenant_job_events(tenant), subjects.tenant_job_reports(tenant)]
            if own and tenant
            else [subjects.JOBS_LIFECYCLE_ALL, subjects.JOBS_REPORTS_ALL]
        )
        subs = [await self.nc.subscribe(subject, cb=queue.put) for subject in watched]
        try:
            while True:
                msg = await queue.get()
                event = _event_of(msg)
                if event is None:
                    continue
                if tenant is not None and event.tenant != tenant:
                    continue
                yield msg.subject, event
        finally:
            # A loop left with ``break`` closes this generator later, from the event loop: by then
            # the client may be closing (``await client.close()`` right after the loop, as the
            # README's example does) and the connection draining, which unsubscribes for us.
            for sub in subs:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
