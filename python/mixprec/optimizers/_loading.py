"""Loading a fused optimizer's checkpoint: every group option and state tensor of a state_dict
checked against the class's rules and the loaded options before anything changes, then copied
into each parameter's device and memory layout (FusedOptimizer's load_state_dict)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from .._dtensor import dtensor_type
from . import _lean
from ._rules import MOMENT, check_state_values, step_count


class CheckpointLoading:
    """FusedOptimizer's ``load_state_dict``; families extend ``_validated_param_state`` for state
    of their own (8-bit moments, param-dtype momentum). Reads the class's rules: ``_state_rules``,
    ``_scalar_state_keys``, ``_required_state``, ``_state_dtypes``, ``_convert_foreign_state``,
    ``_keys_foreign_checkpoints_lack`` and ``_group_attributes``."""

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state_dict made by ``state_dict()``, validating all of it before changing anything."""
        name = type(self).__name__
        # The held steps keep the old state alive (a second copy of every moment) until the next step.
        self.__dict__.pop("_held", None)
        if (not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict)
                or "param_groups" not in state_dict):
            raise ValueError(f"{name}.load_state_dict: expected a dict with 'state' (a dict) and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: the checkpoint has {len(saved_groups)} param groups, "
                             f"this optimizer has {len(self.param_groups)}")
        id_to_param: dict[Any, tuple[torch.Tensor, dict]] = {}
        new_groups = []
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            ok = isinstance(saved, dict) and isinstance(saved.get("params"), (list, tuple))
            if not ok or len(saved["params"]) != len(group["params"]):
                got = len(saved["params"]) if ok else "no"
                raise ValueError(f"{name}.load_state_dict: param group {gi} has {got} params in the checkpoint "
                                 f"but {len(group['params'])} here")
            lack_ok = set(self._keys_foreign_checkpoints_lack) | set(self._group_attributes) | set(_lean.LATER_OPTIONS)
            missing = sorted(set(self.defaults) - set(saved) - lack_ok)
            if missing:
                raise ValueError(f"{name}.load_state_dict: param group {gi} lacks {missing}; "
                                 f"not a {name} checkpoint?")
            self._check_group(dict(self.defaults, **saved), f"{name}.load_state_dict: param group {gi}")
            new_group = {k: v for k, v in saved.items() if k != "params"}
            new_group["params"] = group["params"]
            for key in self._group_attributes + _lean.LATER_OPTIONS:  # checkpoints from before: keep ours
                new_group.setdefault(key, group[key])
            # The loaded options must suit these params (a bf16 run's rounding='stochastic' loaded
            # beside float16 params): else every step would refuse them, after the load changed all.
            _lean.check_params(f"{name}.load_state_dict", new_group, group["params"], f"param group {gi}")
            step = new_group.get("step")
            if step is not None:
                step = step_count(step, f"{name}.load_state_dict: param group {gi} 'step'")
                device = group["params"][0].device if group["params"] else torch.device("cpu")
                new_group["step"] = step.to(device, copy=True)  # never shared with the source
            new_groups.append(new_group)
            before = len(id_to_param)
            id_to_param.update((pid, (p, new_group)) for pid, p in zip(saved["params"], group["params"]))
            if len(id_to_param) != before + len(saved["params"]):
                # A corrupt id list would hand one param's state to another, as torch's loader does.
                pid = next(pid for i, pid in enumerate(saved["params"])
                           if pid in saved["params"][:i] or any(pid in g["params"] for g in saved_groups[:gi]))
                raise ValueError(f"{name}.load_state_dict: param group {gi} lists parameter id {pid!r}, which the "
                                 "checkpoint gives to another parameter too; expected each id once")

        new_state: dict[torch.Tensor, dict] = defaultdict(dict)
        for pid, saved_state in state_dict["state"].items():
            if pid not in id_to_param:
                raise ValueError(f"{name}.load_state_dict: state for unknown parameter id {pid!r}")
            p, new_group = id_to_param[pid]
            new_state[p] = self._validated_param_state(pid, p, saved_state, new_group)

        self.state = new_state
        self.param_groups = new_groups

    def _validated_param_state(self, pid: Any, p: torch.Tensor, saved_state: dict, group: dict) -> dict:
        """One parameter's saved state, checked against the class's rules and the options of its
        loaded `group`, and copied into the parameter's device and memory layout; raises before
        anything is kept."""
        name = type(self).__name__
        if not isinstance(saved_state, dict):
            raise ValueError(f"{name}.load_state_dict: state of parameter {pid} is not a dict")
        out = {}
        for key, value in saved_state.items():
            where = f"{name}.load_state_dict: state[{pid}][{key!r}]"
            if key in self._state_rules or key == "master_param":
                out[key] = self._loaded_state_tensor(key, value, p, where)
            elif key == _lean.REMAINDER:
                out[key] = _lean.loaded_remainder(value, p, where)
            elif key in self._scalar_state_keys:
                step_count(value, where)  # refused unless finite and >= 0
                out[key] = value.detach().to(p.device).clone() if isinstance(value, torch.Tensor) else value
            else:
                raise ValueError(f"{where} is not state {name} knows; expected one of "
                                 f"{sorted(self._state_rules) + ['master_param', _lean.REMAINDER] + list(self._scalar_state_keys)}")
        where = f"{name}.load_state_dict: state[{pid}]"
        lacking = [k for k in self._required_state if k not in out]
        if out and lacking:
            raise ValueError(f"{where} lacks {lacking}; expected {list(self._required_state)} for every "
                             "parameter with state")
        tensors = {k: v for k, v in out.items() if k in self._state_rules}
        if tensors:
            if len({v.dtype for v in tensors.values()}) > 1:
                got = {k: str(v.dtype) for k, v in tensors.items()}
                raise ValueError(f"{where} mixes state dtypes {got}; expected one dtype per parameter")
        has_master = "master_param" in out or _lean.REMAINDER in out
        if group["master_weights"] and p.dtype != torch.float32 and not has_master and tensors:
            raise ValueError(f"{where} has no 'master_param' but master_weights=True and the parameter is {p.dtype}")
        return out

    def _loaded_state_tensor(self, key: str, value: Any, p: torch.Tensor, where: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ValueError(f"{where} is {type(value).__name__ if not isinstance(value, torch.Tensor) else value.dtype}; "
                             "expected a floating-point tensor")
        if value.shape != p.shape:
            raise ValueError(f"{where} has shape {tuple(value.shape)}; expected the parameter's {tuple(p.shape)}")
        cls = dtensor_type()
        if cls is not None and isinstance(value, cls) != isinstance(p, cls):
            raise ValueError(f"{where} is {'a DTensor' if isinstance(value, cls) else 'a plain tensor'} but the "
                             f"parameter is {'a DTensor' if isinstance(p, cls) else 'a plain tensor'}; load "
                             "sharded checkpoints with torch.distributed.checkpoint.state_dict."
                             "set_optimizer_state_dict (mixprec.distributed.CheckpointState)")
        if key == "master_param" and value.dtype != torch.float32:
            raise ValueError(f"{where} has dtype {value.dtype}; expected float32")
        kept = value.dtype in self._state_dtypes or key == "master_param"
        if not kept and not self._convert_foreign_state:
            raise ValueError(f"{where} has dtype {value.dtype}; expected one of {[str(d) for d in self._state_dtypes]}")
        check_state_values(value, self._state_rules.get(key, MOMENT), where)
        # Allowed state dtypes are kept (fp32 moments stay fp32 under fp16 params; Adam's bf16
        # moments stay bf16); others (torch's and Apex's param-dtype state) become float32.
        dtype = value.dtype if kept else torch.float32
        if cls is not None and isinstance(p, cls):
            return value.detach().to(device=p.device, dtype=dtype).clone()
        # In the parameter's layout (channels_last stays channels_last), never sharing memory
        # with the source.
        return torch.empty_like(p, dtype=dtype, device=p.device).copy_(value.detach())
