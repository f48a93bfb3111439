"""The registered policies by name, without importing them: the CLI's ``--help``, its choices and its completions
read the names here and start without torch. :mod:`epikv_cli.policies.registry` loads the classes.

Adding a policy is its file, its line here and ``make docs`` (docs/adding-a-policy.md).
"""

from __future__ import annotations

#: ``--policy`` name -> ``"module:Class"``, one line per policy.
REGISTERED: dict[str, str] = {
    "epikv": "epikv_cli.policies.epikv:EpiKV",
    "epikv2": "epikv_cli.policies.epikv2:EpiKV2",
    "lagkv": "epikv_cli.policies.lagkv:LagKV",
    "streaming": "epikv_cli.policies.baselines:Streaming",
    "random": "epikv_cli.policies.baselines:RandomEviction",
    "full": "epikv_cli.policies.baselines:FullCache",
    "h2o": "epikv_cli.policies.h2o:H2O",
    "tova": "epikv_cli.policies.tova:TOVA",
    "rkv": "epikv_cli.policies.rkv:RKV",
    "knorm": "epikv_cli.policies.knorm:KeyNorm",
}

#: The names, sorted.
POLICY_NAMES: tuple[str, ...] = tuple(sorted(REGISTERED))
