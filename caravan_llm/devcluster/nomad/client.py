"""A simulated Nomad client node: heartbeats, allocation runners, task runners.

Each node runs the allocations the server assigns to it as local processes,
the way a Nomad client does: task events (`Received`, `Task Setup`, `Started`,
`Terminated`, `Restarting`, `Not Restarting`, `Killing`, `Killed`,
`Driver Failure`, `Restart Signal`, `Alloc Unhealthy`), the restart policy,
services and checks registered in Consul, `check_restart`, deployment health,
and the stop sequence: deregister services, wait `ShutdownDelay`, send the
kill signal, SIGKILL after `KillTimeout`.

A killed node stops heartbeating and its processes die at once (SIGKILL to
every process group), as when a machine loses power.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import random
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from caravan_llm.devcluster.nomad.acl import AclStore
from caravan_llm.devcluster.nomad.consul_sync import (
    ConsulAgentClient,
    check_id,
    service_id,
    service_registration,
)
from caravan_llm.devcluster.nomad.drivers import (
    DriverError,
    DriverSettings,
    ExitResult,
    TaskProcess,
    parse_signal,
    resolve_launch,
    start_process,
)
from caravan_llm.devcluster.nomad.endpoints import Endpoints
from caravan_llm.devcluster.nomad.gotext import go_duration, go_quote, go_time
from caravan_llm.devcluster.nomad.model import (
    Allocation,
    Node,
    TaskEvent,
    TaskState,
    find_group,
    group_services,
)
from caravan_llm.devcluster.nomad.taskenv import (
    alloc_environment,
    interpolate,
    node_variables,
    task_environment,
)
from caravan_llm.devcluster.nomad.templates import (
    MissingVariable,
    TemplateError,
    render_texts,
    write_task_templates,
)
from caravan_llm.devcluster.nomad.variables import VariableStore, workload_may_read
from caravan_llm.devcluster.nomad.volumes import (
    VolumeMountError,
    expose_mounts,
    resolve_mounts,
    rewrite_config,
    rewrite_env,
)

Json = dict[str, Any]

log = logging.getLogger(__name__)

CHECK_POLL_S = 1.0
# Nomad's restart jitter: up to a quarter of the delay is added.
RESTART_JITTER = 0.25
REASON_WITHIN_POLICY = "Restart within policy"
REASON_NO_RESTARTS = "Policy allows no restarts"
REASON_UNRECOVERABLE = "Error was unrecoverable"
REASON_DELAY = "Exceeded allowed attempts, applying a delay"
GRACEFUL_SHUTDOWN_S = 2.0


# -- restart policy ------------------------------------------------------


@dataclass(slots=True)
class RestartTracker:
    """`restarts.RestartTracker`: decide what follows a task exit or a failed start."""

    policy: Mapping[str, Any]
    restart_on_success: bool
    rng: random.Random
    interval_start_ns: int
    count: int = 0

    def _jitter(self) -> int:
        delay = max(int(self.policy.get("Delay", 0)), 1)
        return delay + int(self.rng.randrange(delay) * RESTART_JITTER)

    def decide(
        self, now_ns: int, *, exit_result: ExitResult | None, start_error: DriverError | None
    ) -> tuple[str, int, str]:
        """("Restarting" | "Not Restarting" | "Terminated", delay ns, reason)."""
        attempts = int(self.policy.get("Attempts", 0))
        successful = exit_result is not None and exit_result.successful
        if attempts == 0:
            if successful and not self.restart_on_success:
                return "Terminated", 0, REASON_NO_RESTARTS
            return "Not Restarting", 0, REASON_NO_RESTARTS
        if now_ns > self.interval_start_ns + int(self.policy.get("Interval", 0)):
            self.count = 0
            self.interval_start_ns = now_ns
        self.count += 1
        if start_error is not None and not start_error.recoverable:
            return "Not Restarting", 0, REASON_UNRECOVERABLE
        if successful and not self.restart_on_success:
            return "Terminated", 0, "Restart unnecessary as task terminated successfully"
        if self.count > attempts:
            if self.policy.get("Mode") == "fail":
                interval = go_duration(int(self.policy.get("Interval", 0)))
                reason = (
                    f"Exceeded allowed attempts {attempts} in interval {interval} "
                    'and mode is "fail"'
                )
                return "Not Restarting", 0, reason
            remaining = self.interval_start_ns + int(self.policy.get("Interval", 0)) - now_ns
            return "Restarting", max(remaining, 0), REASON_DELAY
        return "Restarting", self._jitter(), REASON_WITHIN_POLICY


# -- tasks ---------------------------------------------------------------


@dataclass(slots=True)
class TaskRunner:
    alloc_runner: AllocRunner
    task: Json
    state: TaskState = field(default_factory=TaskState)
    process: TaskProcess | None = None
    kill_requested: asyncio.Event = field(default_factory=asyncio.Event)
    restart_requested: asyncio.Event = field(default_factory=asyncio.Event)
    killed_by_stop: bool = False
    # The templates' last rendered texts, and whether a re-render asked for this restart.
    template_texts: list[str] = field(default_factory=list)
    template_restart: bool = False

    @property
    def name(self) -> str:
        return str(self.task.get("Name", ""))

    def emit(self, event: TaskEvent, **changes: Any) -> None:
        self.state = dataclasses.replace(self.state.with_event(event), **changes)
        self.alloc_runner.task_changed()

    def now(self) -> int:
        return self.alloc_runner.client.clock_ns()

    def _write_dispatch_payload(self, local_dir: Path) -> None:
        """A dispatched job's payload goes to `local/<DispatchPayload.File>` of the task."""
        target = str((self.task.get("DispatchPayload") or {}).get("File") or "")
        payload = self.alloc_runner.job.get("Payload")
        if not target or not payload:
            return
        alloc_dir = local_dir.parent.parent.resolve()
        path = (local_dir / target).resolve()
        if not path.is_relative_to(alloc_dir):
            return  # refused at registration (destination escapes allocation directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(str(payload)))

    async def run(self) -> None:
        runner = self.alloc_runner
        client = runner.client
        task_dir = runner.alloc_dir / self.name
        for sub in ("local", "secrets", "tmp"):
            (task_dir / sub).mkdir(parents=True, exist_ok=True)
        self._write_dispatch_payload(task_dir / "local")
        self.emit(TaskEvent("Task Setup", self.now(), message="Building Task Directory"))
        try:
            mounts = resolve_mounts(self.task, runner.group, client.node, runner.alloc.name)
            expose_mounts(mounts, task_dir)
        except VolumeMountError as exc:
            # A failed prestart hook is not recoverable: the task is dead and failed.
            self.emit(
                TaskEvent("Task hook failed", self.now(), message=str(exc), fails_task=True),
                state="dead",
                failed=True,
                finished_at_ns=self.now(),
            )
            return
        tracker = RestartTracker(
            policy=self.task.get("RestartPolicy") or {},
            restart_on_success=runner.job.get("Type") in {"service", "system"},
            rng=client.rng,
            interval_start_ns=self.now(),
        )
        while True:
            if self.kill_requested.is_set():
                self.emit(TaskEvent("Killed", self.now()), state="dead", finished_at_ns=self.now())
                return
            template_env = await self._render_templates(task_dir)
            if template_env is None:
                if self.state.state == "dead":
                    return  # the template failed; events already emitted
                continue  # killed while waiting: the top of the loop reports it
            env = task_environment(
                runner.alloc,
                runner.job,
                self.task,
                client.node,
                runner.alloc_dir,
                shared_dir=runner.shared_dir if self.task.get("Driver") == "docker" else None,
            )
            env.update(template_env)  # template env overrides the task's env, as in Nomad
            env = rewrite_env(env, mounts, task_dir)
            exit_result: ExitResult | None = None
            start_error: DriverError | None = None
            try:
                spec = resolve_launch(
                    str(self.task.get("Driver", "")),
                    rewrite_config(self._interpolated_config(env), mounts, task_dir),
                    env=env,
                    ports=runner.alloc.resources.ports,
                    host_ip=client.node.address,
                    task_dir=task_dir,
                    settings=client.driver_settings,
                )
                logs = runner.alloc_dir / "alloc" / "logs"
                self.process = await start_process(
                    spec,
                    cwd=task_dir,
                    stdout=logs / f"{self.name}.stdout.0",
                    stderr=logs / f"{self.name}.stderr.0",
                )
            except DriverError as exc:
                start_error = exc
                self.emit(
                    TaskEvent("Driver Failure", self.now(), driver_error=str(exc), fails_task=False)
                )
            else:
                self.restart_requested.clear()
                self.emit(
                    TaskEvent("Started", self.now()),
                    state="running",
                    started_at_ns=self.now(),
                    finished_at_ns=None,
                )
                watcher = asyncio.ensure_future(self._watch_templates(task_dir))
                try:
                    exit_result = await self._wait_or_kill(self.process)
                finally:
                    watcher.cancel()
                if exit_result is None:
                    return  # killed on request; events already emitted
                if self.template_restart:
                    # Nomad restarts at once and does not count it against the policy.
                    self.template_restart = False
                    self.emit(
                        TaskEvent("Restarting", self.now(), start_delay_ns=0),
                        state="pending",
                        restarts=self.state.restarts + 1,
                        last_restart_ns=self.now(),
                    )
                    continue
            decision, delay, reason = tracker.decide(
                self.now(), exit_result=exit_result, start_error=start_error
            )
            if decision == "Terminated":
                self.emit(
                    TaskEvent("Not Restarting", self.now(), restart_reason=reason),
                    state="dead",
                    finished_at_ns=self.now(),
                )
                return
            if decision == "Not Restarting":
                self.emit(
                    TaskEvent("Not Restarting", self.now(), restart_reason=reason, fails_task=True),
                    state="dead",
                    failed=True,
                    finished_at_ns=self.now(),
                )
                return
            self.emit(
                TaskEvent("Restarting", self.now(), restart_reason=reason, start_delay_ns=delay),
                state="pending",
                restarts=self.state.restarts + 1,
                last_restart_ns=self.now(),
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay / 1e9):
                    await self.kill_requested.wait()

    def _variable_items(self, path: str) -> Mapping[str, str] | None:
        """What this task's workload identity reads at `path` (None: missing or denied)."""
        runner = self.alloc_runner
        store = runner.client.variables
        if store is None:
            return None
        namespace, job_id = runner.alloc.namespace, runner.alloc.job_id
        group = runner.alloc.task_group
        acl = runner.client.acl
        if (
            acl is not None
            and acl.enabled
            and not workload_may_read(path, job_id=job_id, group=group, task=self.name)
            and not acl.workload_acl(namespace, job_id, group, self.name).allow_variable_op(
                namespace, path, "read"
            )
        ):
            return None
        found = store.get(runner.alloc.namespace, path)
        return None if found is None else found.items

    async def _render_templates(self, task_dir: Path) -> dict[str, str] | None:
        """Render the task's templates, waiting while a variable is missing (Nomad's
        template runner blocks the start). None when killed meanwhile or failed."""
        templates = self.task.get("Templates") or []
        if not templates:
            return {}
        reported: str | None = None
        state = self.alloc_runner.client.endpoints.state
        region = str(self.alloc_runner.job.get("Region", "global"))
        while not self.kill_requested.is_set():
            changed = state.changed_event()
            try:
                texts = render_texts(templates, self._variable_items)
                env = write_task_templates(templates, task_dir, texts)
            except MissingVariable as missing:
                namespace = self.alloc_runner.alloc.namespace
                dependency = f"nomad.var.block({missing.path}@{namespace}.{region})"
                if dependency != reported:
                    reported = dependency
                    self.emit(TaskEvent("Template", self.now(), message=f"Missing: {dependency}"))
            except (TemplateError, OSError) as exc:
                self.emit(TaskEvent("Killing", self.now(), kill_reason=f"Template failed: {exc}"))
                self.emit(
                    TaskEvent("Killed", self.now()),
                    state="dead",
                    failed=True,
                    finished_at_ns=self.now(),
                )
                return None
            else:
                self.template_texts = texts
                return env
            kill = asyncio.ensure_future(self.kill_requested.wait())
            write = asyncio.ensure_future(changed.wait())
            try:
                await asyncio.wait({kill, write}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                kill.cancel()
                write.cancel()
        return None

    async def _watch_templates(self, task_dir: Path) -> None:
        """While the task runs, re-render after every write and act on a change by the
        template's `ChangeMode`, as Nomad's template runner does: `restart` restarts the
        task, `signal` sends `ChangeSignal`, `noop` only rewrites the file. A render that
        fails meanwhile (variable gone) keeps the last one."""
        templates = self.task.get("Templates") or []
        if not templates:
            return
        state = self.alloc_runner.client.endpoints.state
        changed_event = state.changed_event()
        while True:
            await changed_event.wait()
            changed_event = state.changed_event()  # taken before reading: no write is missed
            try:
                texts = render_texts(templates, self._variable_items)
            except (MissingVariable, TemplateError):
                continue
            if texts == self.template_texts:
                continue
            changed = [
                template
                for template, old, new in zip(templates, self.template_texts, texts, strict=True)
                if old != new
            ]
            try:
                write_task_templates(templates, task_dir, texts)
            except (TemplateError, OSError):
                continue
            self.template_texts = texts
            modes = {str(t.get("ChangeMode") or "restart") for t in changed}
            if "restart" in modes:
                self.template_restart = True
                self.request_restart("Template with change_mode restart re-rendered")
                return
            for template in changed:
                if str(template.get("ChangeMode")) == "signal" and self.process is not None:
                    self.process.signal_group(parse_signal(str(template.get("ChangeSignal", ""))))
                    self.emit(TaskEvent("Signaling", self.now(), message="Template re-rendered"))

    def _interpolated_config(self, env: Mapping[str, str]) -> Json:
        node_vars = node_variables(
            self.alloc_runner.client.node, str(self.alloc_runner.job.get("Region", "global"))
        )

        def walk(value: Any) -> Any:
            if isinstance(value, str):
                return interpolate(value, env, node_vars)
            if isinstance(value, list):
                return [walk(item) for item in value]
            if isinstance(value, dict):
                return {key: walk(item) for key, item in value.items()}
            return value

        config: Json = walk(dict(self.task.get("Config") or {}))
        return config

    async def _wait_or_kill(self, process: TaskProcess) -> ExitResult | None:
        """The exit of the process, or None when it was killed on request."""
        waiter = asyncio.ensure_future(process.wait())
        kill = asyncio.ensure_future(self.kill_requested.wait())
        restart = asyncio.ensure_future(self.restart_requested.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, kill, restart}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            kill.cancel()
            restart.cancel()
        if waiter in done:
            result = waiter.result()
            self.emit(
                TaskEvent(
                    "Terminated", self.now(), exit_code=result.exit_code, signal=result.signal
                ),
                finished_at_ns=self.now(),
            )
            return result
        if kill in done:
            await self._kill(process, waiter)
            return None
        # check_restart asked for a restart: kill, then let the restart policy decide.
        await self._terminate(process, waiter)
        result = waiter.result()
        self.emit(
            TaskEvent("Terminated", self.now(), exit_code=result.exit_code, signal=result.signal),
            finished_at_ns=self.now(),
        )
        return result

    async def _terminate(self, process: TaskProcess, waiter: asyncio.Future[ExitResult]) -> None:
        kill_timeout_s = int(self.task.get("KillTimeout", 5_000_000_000)) / 1e9
        process.signal_group(parse_signal(str(self.task.get("KillSignal", ""))))
        try:
            async with asyncio.timeout(kill_timeout_s):
                await asyncio.shield(waiter)
        except TimeoutError:
            process.kill_group()
            await waiter

    async def _kill(self, process: TaskProcess, waiter: asyncio.Future[ExitResult]) -> None:
        kill_timeout = int(self.task.get("KillTimeout", 5_000_000_000))
        self.emit(TaskEvent("Killing", self.now(), kill_timeout_ns=kill_timeout))
        await self._terminate(process, waiter)
        result = waiter.result()
        self.emit(
            TaskEvent("Terminated", self.now(), exit_code=result.exit_code, signal=result.signal),
        )
        self.emit(TaskEvent("Killed", self.now()), state="dead", finished_at_ns=self.now())

    def request_kill(self) -> None:
        self.kill_requested.set()

    def request_restart(self, reason: str) -> None:
        if self.state.state != "running":
            return
        self.emit(TaskEvent("Restart Signal", self.now(), restart_reason=reason))
        self.restart_requested.set()

    def hard_kill(self) -> None:
        if self.process is not None:
            self.process.kill_group()


# -- allocations ---------------------------------------------------------


@dataclass(slots=True)
class _CheckWatch:
    check_id: str
    name: str
    interval_ns: int
    limit: int
    grace_ns: int
    ignore_warnings: bool
    task_names: tuple[str, ...]
    unhealthy_since_ns: int | None = None


class AllocRunner:
    def __init__(self, client: ClientNode, alloc: Allocation, job: Json) -> None:
        self.client = client
        self.alloc = alloc
        self.job = job
        self.group = find_group(job, alloc.task_group) or {}
        self.alloc_dir = client.alloc_root / alloc.id
        self.tasks = {
            str(task.get("Name", "")): TaskRunner(self, task)
            for task in self.group.get("Tasks") or []
        }
        self.stop_requested = asyncio.Event()
        self.registered: dict[str, Json] = {}  # service id -> registration
        # False after a sync Consul refused in part (its agent down): `_watch` retries it.
        self.services_in_sync = True
        self.checks: list[_CheckWatch] = []
        self.health_started_ns = client.clock_ns()
        self.healthy_since_ns: int | None = None
        self.deployment_healthy: bool | None = None
        self.dead = False
        # A docker task sees the shared `alloc/` folder at `/alloc`. Here tasks
        # are host processes, so a short link stands in for that mount: the
        # host path under the data dir easily passes the 107 bytes ZeroMQ
        # allows an ipc socket path (a replica's KV events), `/alloc/...` never
        # does. Made when the allocation runs, removed when it is done.
        self._short_root: Path | None = None

    @property
    def shared_dir(self) -> Path:
        """Where docker tasks see the allocation's shared folder (Nomad's `/alloc`)."""
        if self._short_root is None:
            self._short_root = Path(tempfile.mkdtemp(prefix="cva-"))
            (self._short_root / "alloc").symlink_to(self.alloc_dir / "alloc")
        return self._short_root / "alloc"

    def _remove_shared_dir(self) -> None:
        if self._short_root is not None:
            shutil.rmtree(self._short_root, ignore_errors=True)
            self._short_root = None

    # -- reporting ---------------------------------------------------------

    def client_status(self) -> tuple[str, str]:
        states = [runner.state for runner in self.tasks.values()]
        if states and all(state.state == "dead" for state in states):
            if any(state.failed for state in states):
                return "failed", "Failed tasks"
            return "complete", "All tasks have completed"
        if states and all(state.state == "running" for state in states):
            return "running", "Tasks are running"
        if any(state.state == "running" for state in states):
            return "running", "Tasks are running"
        return "pending", "No tasks have started"

    def task_changed(self) -> None:
        if self.client.killed:
            return
        self.report()

    def report(self) -> None:
        current = self.client.endpoints.state.allocs.get(self.alloc.id)
        if current is None:
            return
        status, description = self.client_status()
        deployment_status = current.deployment_status
        if self.deployment_healthy is not None and (
            deployment_status is None or deployment_status.get("Healthy") != self.deployment_healthy
        ):
            deployment_status = {
                "Healthy": self.deployment_healthy,
                "Timestamp": go_time(self.client.clock_ns()),
                "Canary": False,
                "ModifyIndex": 0,
            }
        updated = dataclasses.replace(
            current,
            client_status=status if current.client_status != "lost" else "lost",
            client_description=description
            if current.client_status != "lost"
            else current.client_description,
            task_states={name: runner.state for name, runner in self.tasks.items()},
            deployment_status=deployment_status,
        )
        self.client.endpoints.client_update([updated])

    # -- lifecycle ---------------------------------------------------------

    def update(self, alloc: Allocation) -> None:
        """A new server copy of the allocation: stop it, or take an in-place update."""
        version_changed = alloc.job_version != self.alloc.job_version
        self.alloc = alloc
        if alloc.desired_status != "run":
            self.stop_requested.set()
        elif version_changed:
            job = self.client.endpoints.state.alloc_job(alloc)
            if job is not None:
                self.job = job
                self.group = find_group(job, alloc.task_group) or self.group
                self.client.spawn(self.sync_services())

    async def run(self) -> None:
        for sub in ("alloc/logs", "alloc/data", "alloc/tmp"):
            (self.alloc_dir / sub).mkdir(parents=True, exist_ok=True)
        for runner in self.tasks.values():
            runner.state = runner.state.with_event(TaskEvent("Received", self.client.clock_ns()))
        self.report()
        if self.alloc.desired_status != "run":
            return
        await self.sync_services()
        # Spawned on the node, so that a node kill cancels them with everything else.
        task_runs = [self.client.spawn(self._run_task(runner)) for runner in self.tasks.values()]
        watcher = self.client.spawn(self._watch())
        stop = self.client.spawn(self.stop_requested.wait())
        all_done = asyncio.gather(*task_runs)
        # A node kill cancels the task runs; nobody is left to read that outcome.
        all_done.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            await asyncio.wait({all_done, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not all_done.done():
                await self._shutdown()
                await all_done
        finally:
            watcher.cancel()
            stop.cancel()
            self._remove_shared_dir()
        await self.deregister_services()
        self.dead = True
        self.report()

    async def _run_task(self, runner: TaskRunner) -> None:
        await runner.run()
        self._task_dead(runner)

    def _task_dead(self, runner: TaskRunner) -> None:
        """A dead task that failed, or the group's leader, takes its siblings with it
        (Nomad's `handleTaskStateUpdates`: `Sibling Task Failed`, `Leader Task Dead`)."""
        state = runner.state
        if state.state != "dead":
            return
        now = self.client.clock_ns()
        if state.failed:
            event = TaskEvent(
                "Sibling Task Failed", now, message=f"Task's sibling {go_quote(runner.name)} failed"
            )
        elif runner.task.get("Leader"):
            event = TaskEvent("Leader Task Dead", now, message="Leader Task in Group dead")
        else:
            return
        for other in self.tasks.values():
            if other is runner or other.state.state == "dead" or other.kill_requested.is_set():
                continue
            other.emit(event)
            other.request_kill()

    async def _shutdown(self) -> None:
        """Deregister services, wait `ShutdownDelay`, then kill every task."""
        await self.deregister_services()
        delay_ns = int(self.group.get("ShutdownDelay", 0))
        delay_ns = max(
            delay_ns, *(int(r.task.get("ShutdownDelay", 0)) for r in self.tasks.values())
        )
        if self.alloc.desired_transition.get("NoShutdownDelay"):
            delay_ns = 0
        if delay_ns:
            await asyncio.sleep(delay_ns / 1e9)
        for runner in self.tasks.values():
            runner.request_kill()

    def hard_kill(self) -> None:
        for runner in self.tasks.values():
            runner.hard_kill()

    # -- services ----------------------------------------------------------

    def _registrations(self) -> dict[str, Json]:
        registrations: dict[str, Json] = {}
        group_env = alloc_environment(self.alloc, self.job, self.client.node, self.alloc_dir)
        self.checks = []
        for service, task in group_services(self.group):
            if service.get("Provider", "consul") != "consul":
                continue
            task_name = str(task.get("Name")) if task is not None else None
            env = (
                task_environment(self.alloc, self.job, task, self.client.node, self.alloc_dir)
                if task is not None
                else group_env
            )
            body = service_registration(
                self.alloc, self.job, service, task_name=task_name, node=self.client.node, env=env
            )
            if body is None:
                continue
            registrations[str(body["ID"])] = body
            sid = service_id(self.alloc.id, task_name or f"group-{self.alloc.task_group}", service)
            for check in service.get("Checks") or []:
                restart = check.get("CheckRestart") or {}
                owners = (
                    (task_name,)
                    if task_name
                    else ((str(check["TaskName"]),) if check.get("TaskName") else tuple(self.tasks))
                )
                self.checks.append(
                    _CheckWatch(
                        check_id=check_id(sid, check),
                        name=str(check.get("Name", "")),
                        interval_ns=int(check.get("Interval", 0)),
                        limit=int(restart.get("Limit", 0)),
                        grace_ns=int(restart.get("Grace", 0)),
                        ignore_warnings=bool(restart.get("IgnoreWarnings", False)),
                        task_names=owners,
                    )
                )
        return registrations

    async def sync_services(self) -> None:
        consul = self.client.consul
        wanted = self._registrations()
        if consul is None:
            self.registered = wanted
            return
        # Only what Consul took counts as registered: the rest is retried by `_watch`,
        # as Nomad's service client retries a sync its Consul agent refused.
        registered = dict(self.registered)
        for stale in set(registered) - set(wanted):
            if await consul.deregister_service(self.client.node.name, stale):
                del registered[stale]
        for sid, body in wanted.items():
            if registered.get(sid) != body and await consul.register_service(
                self.client.node.name, body
            ):
                registered[sid] = body
        self.registered = registered
        self.services_in_sync = registered == wanted

    async def deregister_services(self) -> None:
        consul = self.client.consul
        registered, self.registered = self.registered, {}
        if consul is None:
            return
        for sid in registered:
            await consul.deregister_service(self.client.node.name, sid)

    # -- health and check_restart -------------------------------------------

    def _health_settings(self) -> tuple[str, int, int] | None:
        """(health check mode, min healthy time, healthy deadline) when health is tracked."""
        if self.alloc.deployment_id:
            update = self.group.get("Update") or {}
        elif self.alloc.previous_allocation and self.group.get("Migrate"):
            update = self.group["Migrate"]
        else:
            return None
        return (
            str(update.get("HealthCheck", "checks")),
            int(update.get("MinHealthyTime", 0)),
            int(update.get("HealthyDeadline", 0)),
        )

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(CHECK_POLL_S / 2)
            if not self.services_in_sync and not self.stop_requested.is_set():
                await self.sync_services()
            now = self.client.clock_ns()
            statuses = {c.check_id: self.client.check_status(c.check_id) for c in self.checks}
            self._track_health(now, statuses)
            self._check_restarts(now, statuses)

    def _track_health(self, now: int, statuses: Mapping[str, str | None]) -> None:
        settings = self._health_settings()
        if settings is None or self.deployment_healthy is not None:
            return
        mode, min_healthy, deadline = settings
        running = all(runner.state.state == "running" for runner in self.tasks.values())
        checks_ok = mode != "checks" or all(status == "passing" for status in statuses.values())
        if mode == "checks" and self.client.consul is not None and self.checks and not statuses:
            checks_ok = False
        if running and checks_ok:
            if self.healthy_since_ns is None:
                self.healthy_since_ns = now
            if now - self.healthy_since_ns >= min_healthy:
                self.deployment_healthy = True
                self.report()
                return
        else:
            self.healthy_since_ns = None
        if deadline and now - self.health_started_ns > deadline:
            self.deployment_healthy = False
            message = (
                f"Task not running for min_healthy_time of {go_duration(min_healthy)} "
                f"by healthy_deadline of {go_duration(deadline)}"
            )
            for runner in self.tasks.values():
                runner.state = runner.state.with_event(
                    TaskEvent("Alloc Unhealthy", now, message=message)
                )
            self.report()

    def _check_restarts(self, now: int, statuses: Mapping[str, str | None]) -> None:
        for watch in self.checks:
            if watch.limit <= 0:
                continue
            runners = [self.tasks[name] for name in watch.task_names if name in self.tasks]
            started = [
                r.state.started_at_ns
                for r in runners
                if r.state.state == "running" and r.state.started_at_ns
            ]
            if not started or now < max(started) + watch.grace_ns:
                watch.unhealthy_since_ns = None
                continue
            status = statuses.get(watch.check_id)
            unhealthy = status == "critical" or (status == "warning" and not watch.ignore_warnings)
            if not unhealthy:
                watch.unhealthy_since_ns = None
                continue
            if watch.unhealthy_since_ns is None:
                watch.unhealthy_since_ns = now
            if now - watch.unhealthy_since_ns >= watch.interval_ns * (watch.limit - 1):
                watch.unhealthy_since_ns = None
                for runner in runners:
                    runner.request_restart(f'healthcheck: check "{watch.name}" unhealthy')


# -- the node --------------------------------------------------------------


class ClientNode:
    """One simulated Nomad client and its Consul agent identity."""

    def __init__(
        self,
        node: Node,
        endpoints: Endpoints,
        *,
        consul: ConsulAgentClient | None,
        data_dir: Path,
        driver_settings: DriverSettings,
        clock_ns: Callable[[], int],
        rng: random.Random,
        variables: VariableStore | None = None,
        acl: AclStore | None = None,
    ) -> None:
        self.variables = variables
        # Nomad's ACLs (None or disabled: every workload reads every variable).
        self.acl = acl
        self.node = node
        self.endpoints = endpoints
        self.consul = consul
        self.alloc_root = data_dir / node.name / "alloc"
        self.driver_settings = driver_settings
        self.clock_ns = clock_ns
        self.rng = rng
        self.runners: dict[str, AllocRunner] = {}
        self.check_statuses: dict[str, str] = {}
        self.killed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def check_status(self, check_id_: str) -> str | None:
        return self.check_statuses.get(check_id_)

    async def start(self) -> None:
        """Register with Consul and the server, then heartbeat and run allocations."""
        self.killed = False
        if self.consul is not None:
            await self.consul.register_node(self.node.name, self.node.address)
        self.node = self.endpoints.register_node(self.node)
        self.spawn(self._heartbeat_loop())
        self.spawn(self._alloc_loop())
        if self.consul is not None:
            self.spawn(self._check_loop(self.consul))

    async def _heartbeat_loop(self) -> None:
        # As a Nomad client: heartbeat again after the TTL the server handed back.
        while True:
            ttl_s = self.endpoints.heartbeat(self.node.id)
            await asyncio.sleep(ttl_s)

    async def _check_loop(self, consul: ConsulAgentClient) -> None:
        while True:
            statuses = await consul.check_statuses(self.node.name)
            if statuses is not None:
                self.check_statuses = statuses
            await asyncio.sleep(CHECK_POLL_S)

    async def _alloc_loop(self) -> None:
        state = self.endpoints.state
        while True:
            changed = state.changed_event()
            for alloc in state.allocs_of_node(self.node.id):
                runner = self.runners.get(alloc.id)
                if runner is not None:
                    if alloc.modify_index != runner.alloc.modify_index:
                        runner.update(alloc)
                    continue
                if alloc.terminal:
                    continue
                job = state.alloc_job(alloc)
                if job is None:
                    continue
                runner = AllocRunner(self, alloc, job)
                self.runners[alloc.id] = runner
                self.spawn(runner.run())
            await changed.wait()

    def kill(self) -> None:
        """Power loss: every process dies now, heartbeats and reports stop."""
        self.killed = True
        for runner in self.runners.values():
            runner.hard_kill()
        for task in list(self._tasks):
            task.cancel()

    async def wait_stopped(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        """Agent shutdown: SIGTERM every task, SIGKILL what is left after a grace."""
        self.killed = True
        processes = [
            r.process
            for a in self.runners.values()
            for r in a.tasks.values()
            if r.process is not None
        ]
        for process in processes:
            process.signal_group(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(GRACEFUL_SHUTDOWN_S):
                await asyncio.gather(*(p.process.wait() for p in processes))
        for process in processes:
            process.kill_group()
        await self.wait_stopped()

    async def restart(self) -> None:
        """Come back empty: forget old runners, clean stale services, re-register."""
        await self.wait_stopped()
        stale = list(self.runners.values())
        self.runners = {}
        self.check_statuses = {}
        if self.consul is not None:
            await self.consul.recover_node(self.node.name)
            for runner in stale:
                for sid in runner.registered:
                    await self.consul.deregister_service(self.node.name, sid)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.alloc_root)
        await self.start()
