"""The scheduler's settings: one frozen `SchedulerSettings`, read once by the wiring.

Every field can be set as `CARAVAN_SCHEDULER_<FIELD>` in the environment (the
`caravan scheduler` flags override a few). Units are in the names. Where Nomad
and Consul are comes from their standard variables instead (`NOMAD_ADDR`,
`CONSUL_HTTP_ADDR`, ... read by `caravan_llm.common.nomad_api.NomadSettings.from_env` and
`caravan_llm.common.consul_api.ConsulSettings.from_env`), exactly as their CLIs read them.

`CARAVAN_KV_PREFIX`, the variable older releases read, is still accepted as a
deprecated alias of `CARAVAN_SCHEDULER_KV_PREFIX` (which wins when both are
set); the process logs `deprecated_setting` when it is the one used.

The API tokens keep their names: `CARAVAN_SCHEDULER_API_TOKENS`
(comma-separated) and `CARAVAN_SCHEDULER_API_TOKENS_FILE` (re-read when it
changes); `token_source()` turns them into what the API's middleware reads.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from caravan_llm.common.contract import KVLayout
from caravan_llm.common.leader import ElectionSettings
from caravan_llm.scheduler.api_auth import TokenSource, load_token_source
from caravan_llm.scheduler.autoscale.loop import AutoscalerSettings
from caravan_llm.scheduler.controller import ControllerSettings
from caravan_llm.scheduler.plan import PlanSettings

ENV_PREFIX = "CARAVAN_SCHEDULER_"
# Read by releases before SchedulerSettings; still honoured (module docstring).
DEPRECATED_KV_PREFIX_ENV = "CARAVAN_KV_PREFIX"
LEADER_SESSION_NAME = "caravan-scheduler"


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class SchedulerSettings(BaseSettings):
    """Everything the scheduler process is configured with."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        # An empty variable counts as unset (as `CARAVAN_SCHEDULER_API_TOKENS_FILE=` did).
        env_ignore_empty=True,
    )

    # -- HTTP API -------------------------------------------------------------------
    http_host: str = Field(
        default="127.0.0.1",
        description="where the API listens; with no token configured it is 127.0.0.1 "
        "whatever this says (logged as `scheduler_api_loopback_only`)",
    )
    http_port: int = Field(default=8090, ge=0, le=65535, description="API port (0 = any free)")
    api_tokens: SecretStr | None = Field(
        default=None,
        description="comma-separated bearer tokens of the API (>= 16 characters each)",
    )
    api_tokens_file: Path | None = Field(
        default=None,
        description="a file of tokens, one a line, `#` comments; re-read when it changes "
        "(rotation without restart)",
    )

    # -- Consul KV and cluster --------------------------------------------------------
    kv_prefix: str = Field(
        default="caravan/",
        validation_alias=AliasChoices(f"{ENV_PREFIX}KV_PREFIX", DEPRECATED_KV_PREFIX_ENV),
        description=f"Consul KV prefix of caravan's state (`{DEPRECATED_KV_PREFIX_ENV}`: "
        "deprecated alias)",
    )
    cluster_config: Path | None = Field(
        default=None, description="cluster config YAML (GPU classes, images, profile policy)"
    )
    # Longest wait of one Consul or Nomad blocking query of the watches.
    watch_wait_s: float = Field(
        default=60.0,
        gt=0,
        le=600,
        description="longest wait of one blocking query of the KV and Nomad watches",
    )

    # -- leader election ----------------------------------------------------------------
    instance_id: str | None = Field(
        default=None,
        min_length=1,
        description="this instance's name in the leader lock (default `<hostname>-<pid>`)",
    )
    leader_ttl_s: float = Field(
        default=15.0,
        gt=0,
        le=86400.0,
        description="session TTL of the leader lock; Consul refuses less than its "
        "`session_ttl_min` (10s by default) and more than 24h",
    )
    leader_lock_delay_s: float = Field(
        default=5.0,
        ge=0,
        le=60.0,
        description="Consul lock-delay after a leader's session is invalidated; a dead "
        "leader is replaced within about TTL + lock-delay",
    )
    leader_retry_interval_s: float = Field(
        default=1.0, gt=0, description="pause after a failed election step"
    )
    leader_resign_timeout_s: float = Field(
        default=5.0,
        ge=0,
        description="how long a stopping leader tries to release the lock and destroy its "
        "session, so a standby takes over at once",
    )

    # -- reconcile loop (controller) ----------------------------------------------------
    resync_s: float = Field(
        default=30.0, gt=0, description="periodic reconcile even when nothing signalled"
    )
    apply_concurrency: int = Field(default=4, ge=1, description="Nomad writes applied at once")
    empty_list_confirm_s: float = Field(
        default=30.0,
        ge=0,
        description="how long a suddenly empty Nomad job list must persist before it is believed",
    )
    backoff_initial_s: float = Field(
        default=1.0, gt=0, description="first retry delay after a failed reconcile"
    )
    backoff_max_s: float = Field(default=30.0, gt=0, description="longest retry delay")

    # -- planner --------------------------------------------------------------------------
    replace_lost_after_s: float = Field(
        default=60.0,
        ge=0,
        description="how long a lost replica may go unreplaced before caravan re-registers it",
    )
    orphan_confirm_s: float = Field(
        default=15.0,
        ge=0,
        description="how long replicas must be seen without their profile before they drain",
    )
    sibling_wait_s: float = Field(
        default=15.0,
        ge=0,
        description="how long a new CPU replica waits for its siblings to be placed",
    )
    move_backoff_s: float = Field(
        default=600.0,
        ge=0,
        description="least time between two moves of a CPU replica off a sibling's node",
    )
    requeue_s: float = Field(
        default=2.0, gt=0, description="pass again this soon while waiting on placement/readiness"
    )

    # -- autoscaler -----------------------------------------------------------------------
    autoscale: bool = Field(
        default=True, description="run the autoscaler (false: counts only by `caravan scale`)"
    )
    autoscale_tick_s: float = Field(
        default=5.0, gt=0, description="how often the autoscaler scrapes and decides"
    )
    autoscale_scrape_timeout_s: float = Field(
        default=2.0, gt=0, description="longest scrape of one engine's or router's metrics"
    )

    # -- operations -----------------------------------------------------------------------
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="lowest level logged"
    )
    log_format: Literal["json", "text"] = Field(
        default="json", description="log lines on stderr: JSON, or text for people"
    )

    @field_validator("kv_prefix")
    @classmethod
    def _valid_prefix(cls, value: str) -> str:
        KVLayout(value)  # raises naming the prefix
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SchedulerSettings:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(
                f"backoff_initial_s ({self.backoff_initial_s}) must not exceed "
                f"backoff_max_s ({self.backoff_max_s})"
            )
        return self

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.kv_prefix)

    def instance_name(self) -> str:
        """The value this instance writes into the leader lock."""
        return self.instance_id or _default_instance_id()

    def token_source(self) -> TokenSource | None:
        """The API's tokens (None: none configured, loopback only).

        Raises ApiTokenError (a SettingsError) naming the variable or file.
        """
        tokens = self.api_tokens.get_secret_value() if self.api_tokens is not None else None
        tokens_file = str(self.api_tokens_file) if self.api_tokens_file is not None else None
        return load_token_source(tokens, tokens_file)

    def plan_settings(self) -> PlanSettings:
        return PlanSettings(
            replace_lost_after_s=self.replace_lost_after_s,
            orphan_confirm_s=self.orphan_confirm_s,
            sibling_wait_s=self.sibling_wait_s,
            move_backoff_s=self.move_backoff_s,
            requeue_s=self.requeue_s,
        )

    def controller_settings(self) -> ControllerSettings:
        return ControllerSettings(
            plan=self.plan_settings(),
            resync_s=self.resync_s,
            apply_concurrency=self.apply_concurrency,
            empty_list_confirm_s=self.empty_list_confirm_s,
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=self.backoff_max_s,
        )

    def autoscaler_settings(self) -> AutoscalerSettings:
        return AutoscalerSettings(
            tick_s=self.autoscale_tick_s, scrape_timeout_s=self.autoscale_scrape_timeout_s
        )

    def election_settings(self) -> ElectionSettings:
        layout = self.kv_layout
        return ElectionSettings(
            key=layout.leader,
            value=self.instance_name().encode(),
            session_name=LEADER_SESSION_NAME,
            ttl_s=self.leader_ttl_s,
            lock_delay_s=self.leader_lock_delay_s,
            retry_interval_s=self.leader_retry_interval_s,
            shutdown_timeout_s=self.leader_resign_timeout_s,
        )
