"""The Cloud TPU supervisor's flags, and the call that runs training under it.

A launcher calls ``define_flags()`` next to its own (``--tpu``, ``--tpu_zone`` and
``--gcp_project`` belong to the launcher), then, in ``main``::

    run_supervised(lambda restart: train(config), FLAGS.tpu, FLAGS.tpu_zone,
                   FLAGS.gcp_project, log=print)

The policy itself lives in ``hybrid.platforms.cloud_tpu`` (flag-free): its errors name the
node's arguments (``tpu=``, ``zone=``, ``project=``) and ``SupervisorConfig`` fields, which
:func:`flag_terms` rewords as this launcher's flags for the person at the command line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from absl import flags

__all__ = ["define_flags", "flag_terms", "run_supervised"]

T = TypeVar("T")

# hybrid.platforms.cloud_tpu's names for the settings -> the flags that set them.
_SETTING_FLAGS = {
    "SupervisorConfig.max_restarts": "--tpu_max_restarts",
    "SupervisorConfig.wait_timeout_s": "--tpu_wait_timeout",
    "SupervisorConfig.poll_interval_s": "--tpu_poll_interval",
}
# The node's arguments (resolve(), client()) -> the launcher's flags.
_NODE_FLAGS = {"tpu": "--tpu", "zone": "--tpu_zone", "project": "--gcp_project"}
_NODE_ARGUMENT = re.compile(r"(?<![\w-])(tpu|zone|project)(?==)")  # tpu='...', not --zone=
_EMPTY_ARGUMENT = re.compile(r"^(tpu|zone|project) is empty")


def flag_terms(message: str) -> str:
    """``message`` from ``hybrid.platforms.cloud_tpu`` with its argument and setting names
    replaced by this launcher's flags.

    ``SupervisorConfig.wait_timeout_s`` becomes ``--tpu_wait_timeout`` (and so on for
    ``max_restarts`` and ``poll_interval_s``); the node's ``tpu='n', zone='z', project='p'``
    becomes ``--tpu='n', --tpu_zone='z', --gcp_project='p'``, as do ``<tpu>``-style
    placeholders, the phrase ``tpu, zone and project`` and a leading ``zone is empty``.
    Other text (gcloud's own ``--zone=ZONE``, node names) stays as it is.
    """
    for setting, flag in _SETTING_FLAGS.items():
        message = message.replace(setting, flag)
    message = _NODE_ARGUMENT.sub(lambda m: _NODE_FLAGS[m.group(1)], message)
    message = _EMPTY_ARGUMENT.sub(lambda m: f"{_NODE_FLAGS[m.group(1)]} is empty", message)
    for argument, flag in _NODE_FLAGS.items():
        message = message.replace(f"<{argument}>", f"<{flag}>")
    return message.replace("tpu, zone and project", "--tpu, --tpu_zone and --gcp_project")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines ``--tpu_max_restarts``, ``--tpu_wait_timeout``, ``--tpu_poll_interval``,
    ``--tpu_discovery_url`` and ``--tpu_anonymous_credentials`` on ``flag_values``, with
    validators for their combinations."""
    _define_supervisor_flags(flag_values)
    _define_api_flags(flag_values)
    flags.register_multi_flags_validator(
        ["tpu_wait_timeout", "tpu_poll_interval"], _check_times, flag_values=flag_values
    )
    flags.register_multi_flags_validator(
        ["tpu_anonymous_credentials", "tpu_discovery_url"],
        _check_credentials,
        flag_values=flag_values,
    )


def _define_supervisor_flags(flag_values: flags.FlagValues) -> None:
    """The flags of ``SupervisorConfig``: restarts, wait timeout and polling interval."""
    flags.DEFINE_integer(
        "tpu_max_restarts",
        10,
        "Cloud TPU: restarts allowed over the whole run after runtime failures (preemptions).",
        lower_bound=0,
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "tpu_wait_timeout",
        1800.0,
        "Cloud TPU: seconds to wait, after a failure, for the node to be READY and HEALTHY.",
        lower_bound=0.0,
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "tpu_poll_interval",
        30.0,
        "Cloud TPU: seconds between two looks at the node's state while waiting.",
        lower_bound=0.0,
        flag_values=flag_values,
    )


def _define_api_flags(flag_values: flags.FlagValues) -> None:
    """The flags of the Cloud TPU API client: discovery URL and anonymous credentials."""
    flags.DEFINE_string(
        "tpu_discovery_url",
        None,
        "Cloud TPU API discovery URL template with {api} and {apiVersion} (default: Google's); "
        "for testing against a local fake API.",
        flag_values=flag_values,
    )
    flags.DEFINE_bool(
        "tpu_anonymous_credentials",
        False,
        "Call the Cloud TPU API without credentials; only with --tpu_discovery_url (a local "
        "fake API).",
        flag_values=flag_values,
    )


def _check_times(values: dict[str, Any]) -> bool:
    """``--tpu_wait_timeout`` > 0 and 0 < ``--tpu_poll_interval`` <= ``--tpu_wait_timeout``."""
    timeout, poll = values["tpu_wait_timeout"], values["tpu_poll_interval"]
    if timeout <= 0:
        raise flags.ValidationError(f"--tpu_wait_timeout={timeout} must be > 0 seconds")
    if not 0 < poll <= timeout:
        raise flags.ValidationError(
            f"--tpu_poll_interval={poll} must be > 0 and at most --tpu_wait_timeout={timeout}"
        )
    return True


def _check_credentials(values: dict[str, Any]) -> bool:
    """``--tpu_anonymous_credentials`` only with ``--tpu_discovery_url``."""
    if values["tpu_anonymous_credentials"] and not values["tpu_discovery_url"]:
        raise flags.ValidationError(
            "--tpu_anonymous_credentials needs --tpu_discovery_url: Google's Cloud TPU API "
            "refuses anonymous calls"
        )
    return True


def _oom_is_fatal(flag_values: flags.FlagValues) -> bool:
    """cloud_tpu_client's own ``--runtime_oom_exit`` (defined when it is imported), else True."""
    if "runtime_oom_exit" in flag_values:
        return bool(flag_values["runtime_oom_exit"].value)
    return True


def run_supervised(
    attempt: Callable[[int], T],
    tpu: str,
    zone: str,
    project: str,
    log: Callable[[str], None],
    flag_values: flags.FlagValues = flags.FLAGS,
) -> T:
    """Runs ``attempt(restart)`` under ``hybrid.platforms.cloud_tpu.supervise`` with the flags'
    settings; the supervisor's lines and errors name flags (see :func:`flag_terms`).

    Args:
      attempt: one training attempt that restores the latest checkpoint and trains to the end.
      tpu, zone, project: the node (``--tpu``, ``--tpu_zone``, ``--gcp_project``).
      log: receives the supervisor's lines.
      flag_values: parsed flags holding those of ``define_flags()``.

    Returns:
      What the attempt that finishes returns.

    Raises:
      ValueError: ``--tpu``, ``--tpu_zone`` or ``--gcp_project`` names no node.
      hybrid.platforms.cloud_tpu.TPURecoveryError: the supervisor gave up (the message says
        why, and which flag to change).
    """
    # Imports TensorFlow: only once the launcher has set the devices.
    from hybrid.platforms import cloud_tpu

    config = cloud_tpu.SupervisorConfig(
        max_restarts=flag_values.tpu_max_restarts,
        wait_timeout_s=flag_values.tpu_wait_timeout,
        poll_interval_s=flag_values.tpu_poll_interval,
        oom_is_fatal=_oom_is_fatal(flag_values),
    )
    credentials: Any = "default"
    if flag_values.tpu_anonymous_credentials:
        from google.auth.credentials import AnonymousCredentials

        credentials = AnonymousCredentials()
    try:
        node = cloud_tpu.client(
            tpu, zone, project, discovery_url=flag_values.tpu_discovery_url, credentials=credentials
        )
    except ValueError as err:
        _reword(err)
        raise
    log(
        f"supervising TPU node projects/{project}/locations/{zone}/nodes/{tpu}: up to "
        f"{config.max_restarts} restart(s), waiting up to {config.wait_timeout_s:g} s for the "
        f"node after a failure, looking every {config.poll_interval_s:g} s"
    )
    try:
        return cloud_tpu.supervise(attempt, node, config, log=lambda line: log(flag_terms(line)))
    except cloud_tpu.TPURecoveryError as err:
        _reword(err)
        raise


def _reword(err: BaseException) -> None:
    """Puts ``err``'s message in flag terms, in place: its type, attributes, cause and
    traceback stay as they are."""
    if err.args:
        err.args = (flag_terms(str(err.args[0])), *err.args[1:])
