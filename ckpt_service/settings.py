"""Service settings: command-line flags > environment (`CKPT_…`) > config file (TOML or JSON) > defaults.

Validated once at start-up; `ckptctl serve --print-config` shows the effective values with secrets
masked. List settings take JSON (`["/a", "/b"]`) or comma-separated text in the environment.
"""

from __future__ import annotations

import ipaddress
import json
import os
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from . import auth, roots
from .service_errors import ServiceError, SettingsError

if TYPE_CHECKING:
    from converters import EngineConfig

CONFIG_ENV = "CKPT_CONFIG"
DB_NAME = "ckpt.db"


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "ckpt-service"


def _split(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


StrList = Annotated[list[str], NoDecode]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPT_", extra="forbid", validate_default=True)

    data_dir: Path = Field(default_factory=default_data_dir, description="Job store and default storage root.")
    database_url: str | None = Field(None, description="postgresql://USER[:PASSWORD]@HOST[:PORT]/DB: keep the job "
                                     "store in PostgreSQL, shared by API replicas and worker hosts (default: SQLite "
                                     "under the data dir).")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: int = Field(2, ge=0, le=64, description="Job slots in this process (each job runs in its own process).")
    max_attempts: int = Field(2, ge=1, le=10, description="Runs of a job whose process died before it is failed.")
    queue_limit: int = Field(100, ge=1, le=100_000, description="Queued jobs beyond which POST /v1/jobs gets 429.")
    lease_seconds: float = Field(15.0, gt=0, le=3600, description="A running job whose worker is silent this long "
                                 "is requeued.")
    heartbeat_seconds: float = Field(1.0, gt=0, le=600)
    poll_seconds: float = Field(0.5, gt=0, le=60, description="How often idle workers look for queued jobs.")
    progress_seconds: float = Field(0.5, gt=0, le=60, description="Least time between stored progress updates.")
    read_roots: StrList = Field(default_factory=list, description="URIs jobs may read (default: the data dir).")
    write_roots: StrList = Field(default_factory=list, description="URIs jobs may write (default: the data dir).")
    tokens: StrList = Field(default_factory=list, description="NAME:SCOPE:sha256:HEX entries (ckptctl token create).")
    allow_anonymous: bool | None = Field(None, description="Accept requests without a token (default: only when no "
                                         "tokens are set and the server listens on loopback).")
    metrics_public: bool = Field(True, description="Serve /metrics without a token.")
    max_request_bytes: int = Field(1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    callback_timeout: float = Field(5.0, gt=0, le=120)
    callback_attempts: int = Field(3, ge=1, le=10)
    callback_allow: StrList = Field(default_factory=list, description="Hosts, addresses or CIDR networks that "
                                    "callbacks may reach although not public (e.g. hooks.internal, 10.1.0.0/16).")
    sse_max_streams: int = Field(100, ge=1, le=100_000, description="Open event streams (GET /v1/jobs/{id}/events) "
                                 "this API process serves at once; more get 429.")
    sse_max_streams_per_principal: int = Field(10, ge=1, le=100_000, description="Open event streams per token name.")
    store_check_seconds: float = Field(60.0, ge=0, le=86400, description="How often /readyz re-runs the job "
                                       "store's integrity check (PRAGMA quick_check).")
    job_max_bytes_per_second: int = Field(0, ge=0, description="Bandwidth cap per job, in tensor bytes per second "
                                          "(0: none); keeps shared filesystems usable while jobs run.")
    job_nice: int = Field(10, ge=0, le=19, description="Niceness of job processes, so the API stays responsive.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # OpenID Connect sign-in (oidc.py); static tokens keep working beside it
    oidc_issuer: str | None = Field(None, description="Accept JWT access tokens from this OpenID Connect issuer "
                                    "(https://…, exactly as its discovery document's `issuer`).")
    oidc_audience: str | None = Field(None, description="The `aud` those tokens must carry (this service's "
                                      "resource or client id at the issuer).")
    oidc_groups_claim: str = Field("groups", min_length=1, max_length=128, description="The claim holding the "
                                   "caller's groups (or roles).")
    oidc_group_roles: dict[str, dict[str, auth.Scope]] = Field(
        default_factory=dict, description='{GROUP: {ROOT_URI_PREFIX: read|write|admin}} as JSON; "*" as the '
        "prefix: every root. A token none of whose groups is listed is refused (403).")
    oidc_algorithms: StrList = Field(default_factory=lambda: ["RS256", "ES256", "PS256"], description="JWS "
                                     "algorithms accepted (asymmetric only; none and HS* are always refused).")
    oidc_client_id: str | None = Field(None, max_length=256, description="The dashboard's client at the issuer (a "
                                       "public client: authorization code with PKCE); unset: no SSO button.")
    oidc_redirect_uri: str | None = Field(None, max_length=2048, description="Where the issuer sends the browser "
                                          "back (default: this server's URL + /v1/session/callback, as requested).")
    oidc_leeway_seconds: float = Field(30.0, ge=0, le=300, description="Clock skew allowed on exp, nbf and iat.")
    oidc_jwks_seconds: float = Field(300.0, ge=1, le=86400, description="How long the issuer's keys are cached.")
    oidc_refetch_seconds: float = Field(10.0, ge=0, le=3600, description="Least time between key downloads when "
                                        "a token names an unknown key id (key rotation).")
    # checkpoint management (catalog.py, retention.py, rules.py)
    run_pattern: str = Field("{run}/step_{step}", min_length=1, max_length=512, description="Where a checkpoint's "
                             "path names its run and step: the last path segments, {run} and {step} in them.")
    discover_seconds: float = Field(30.0, ge=0, le=86400, description="How often rules look for new complete "
                                    "checkpoints (0: only on POST /v1/notify).")
    gc_seconds: float = Field(0.0, ge=0, le=30 * 86400, description="How often the service runs garbage collection "
                              "under the retention policies (0: only on request).")
    gc_batch: int = Field(50, ge=1, le=10_000, description="Checkpoints marked deleted per transaction.")
    executor: Literal["local", "ray"] = Field("local", description="Who writes a job's output files: its own "
                                              "process (local) or Ray tasks across a cluster (ray).")
    ray_address: str = Field("auto", description="The Ray cluster for executor=ray: ray://HOST:10001, or auto "
                             "(the cluster this host belongs to). The target must be on storage every Ray "
                             "node sees (a shared filesystem or object storage).")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls),
                JsonConfigSettingsSource(settings_cls))

    @field_validator("oidc_group_roles", mode="before")
    @classmethod
    def _roles_json(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    @field_validator("oidc_group_roles", mode="after")
    @classmethod
    def _group_roles(cls, value: dict[str, dict[str, auth.Scope]]) -> dict[str, dict[str, auth.Scope]]:
        try:
            return {group: {prefix if prefix == "*" else roots.parse_root(prefix).uri(): role
                            for prefix, role in entries.items()} for group, entries in value.items()}
        except ServiceError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("oidc_algorithms", mode="after")
    @classmethod
    def _algorithms(cls, value: list[str]) -> list[str]:
        from .oidc import KEY_TYPES

        for alg in value:
            if alg not in KEY_TYPES:
                raise ValueError(f"algorithm {alg[:20]!r} refused: choose among {', '.join(KEY_TYPES)} "
                                 "(none and HMAC algorithms are never accepted)")
        if not value:
            raise ValueError("give at least one algorithm")
        return value

    @field_validator("oidc_issuer", mode="after")
    @classmethod
    def _issuer(cls, value: str | None) -> str | None:
        if not value:
            return None
        import httpx

        try:
            url = httpx.URL(value)
        except httpx.InvalidURL:
            raise ValueError("give the issuer's https:// URL") from None
        if url.scheme != "https" and not (url.scheme == "http" and is_loopback(url.host)):
            raise ValueError("the issuer must be an https:// URL (plain http only on loopback, for tests)")
        if url.query or url.fragment:
            raise ValueError("the issuer URL has no query or fragment")
        return value

    @field_validator("read_roots", "write_roots", "tokens", "callback_allow", "oidc_algorithms", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("database_url", mode="after")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        from .dialect import is_url

        if not value:
            return None  # CKPT_DATABASE_URL= (empty): SQLite
        if not is_url(value):
            raise ValueError("give a postgresql://USER@HOST[:PORT]/DATABASE URL (or leave it unset for SQLite)")
        return value

    @field_validator("data_dir", mode="after")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return Path(os.path.abspath(os.path.expanduser(str(value))))

    @field_validator("read_roots", "write_roots", mode="after")
    @classmethod
    def _roots(cls, value: list[str]) -> list[str]:
        try:
            return [roots.parse_root(text).uri() for text in value]
        except ServiceError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("callback_allow", mode="after")
    @classmethod
    def _callback_allow(cls, value: list[str]) -> list[str]:
        from .netguard import CallbackPolicy

        CallbackPolicy.parse(value)
        return value

    @field_validator("run_pattern", mode="after")
    @classmethod
    def _run_pattern(cls, value: str) -> str:
        from .catalog import compile_pattern

        try:
            compile_pattern(value)
        except ServiceError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("tokens", mode="after")
    @classmethod
    def _tokens(cls, value: list[str]) -> list[str]:
        return [auth.parse_entry(text).line() for text in value]

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise ValueError("heartbeat_seconds must be at most half of lease_seconds")
        if self.oidc_issuer and not self.oidc_audience:
            raise ValueError("oidc_issuer is set but oidc_audience is not: give the aud this service's tokens carry")
        if not self.tokens and not self.oidc_issuer and not self.anonymous:
            raise ValueError(f"no tokens configured and the server listens on {self.host}: add one (ckptctl token "
                             "create) to CKPT_TOKENS, or set CKPT_ALLOW_ANONYMOUS=true")
        return self

    @property
    def anonymous(self) -> bool:
        if self.allow_anonymous is not None:
            return self.allow_anonymous
        return not self.tokens and not self.oidc_issuer and is_loopback(self.host)

    @property
    def db_path(self) -> Path:
        return self.data_dir / DB_NAME

    @property
    def store_location(self) -> str:
        """Where the job store is: the PostgreSQL URL, or the SQLite file under the data dir."""
        return self.database_url or str(self.db_path)

    @cached_property
    def write_locations(self) -> list[roots.Location]:
        return [roots.parse_root(r) for r in self.write_roots or [str(self.data_dir)]]

    @cached_property
    def read_locations(self) -> list[roots.Location]:
        found = [roots.parse_root(r) for r in self.read_roots or [str(self.data_dir)]]
        return found + [r for r in self.write_locations if r not in found]

    @cached_property
    def callback_policy(self) -> Any:
        from .netguard import CallbackPolicy

        return CallbackPolicy.parse(self.callback_allow)

    def token_checker(self) -> auth.TokenChecker:
        verifier = None
        if self.oidc_issuer and self.oidc_audience:
            from .oidc import OidcConfig, OidcVerifier

            verifier = OidcVerifier(OidcConfig(
                self.oidc_issuer, self.oidc_audience, self.oidc_groups_claim, tuple(self.oidc_algorithms),
                self.oidc_leeway_seconds, self.oidc_jwks_seconds, self.oidc_refetch_seconds,
                OidcConfig.roles_tuple(self.oidc_group_roles)))
        return auth.TokenChecker([auth.parse_entry(t) for t in self.tokens], self.anonymous, verifier)

    def prepare(self) -> None:
        """Create the data dir (and nothing else): called by the commands that serve or work."""
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration for this service's jobs: the engine's own `CKPT_*` variables (pickle and
        metadata limits, upload parallelism, Ray part size: `EngineConfig.from_env`), with these settings'
        executor and Ray address, and reads confined to the read and write roots (symlinks resolved)."""
        from converters import CkptError, EngineConfig

        try:
            base = EngineConfig.from_env()
        except CkptError as exc:
            raise SettingsError(f"engine setting {exc}") from None
        confined = tuple(dict.fromkeys(str(r) for r in (*self.read_locations, *self.write_locations)))
        return base.replace(executor=self.executor, ray_address=self.ray_address, read_roots=confined)

    def masked(self) -> dict[str, Any]:
        """The effective settings as JSON-able values, token hashes masked; `engine`: the engine config jobs
        run under."""
        values = self.model_dump(mode="json")
        values["tokens"] = [line.rsplit(":", 1)[0] + ":****" for line in self.tokens]
        if self.database_url:
            from .dialect import redact

            values["database_url"] = redact(self.database_url)
        values["effective_read_roots"] = [str(r) for r in self.read_locations]
        values["effective_write_roots"] = [str(r) for r in self.write_locations]
        values["anonymous_access"] = self.anonymous
        values["engine"] = self.engine_config().to_dict()
        return values


def load(config: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Settings from flags (`overrides`; None means not given), environment and an optional config file."""
    path = config or os.environ.get(CONFIG_ENV)
    given = {k: v for k, v in overrides.items() if v is not None}
    if not path:
        return _checked(Settings(**given))
    file = Path(path).expanduser()
    if not file.is_file():
        raise SettingsError(f"config file {file}: not found")
    key = {".toml": "toml_file", ".json": "json_file"}.get(file.suffix.lower())
    if key is None:
        raise SettingsError(f"config file {file}: use a .toml or .json file")
    cls = type("Settings", (Settings,), {"model_config": {**Settings.model_config, key: file}})
    return _checked(cls(**given))


def _checked(settings: Settings) -> Settings:
    settings.engine_config()  # a bad engine variable (CKPT_MAX_PICKLE_DEPTH=x) stops start-up, in one line
    return settings


def describe(error: ValidationError) -> str:
    """One line per invalid setting, naming it; values are never echoed (they may be secrets)."""
    lines = []
    for item in error.errors():
        name = ".".join(str(p) for p in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"setting {name}: {message}" if name else message)
    return "\n".join(lines)
