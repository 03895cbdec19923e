"""What :class:`~fibrl.rl.envs.RemoteVectorEnv` needs to know about gymnasium spaces.

Owns three decisions, made once when a vector env is built:

- how a space's batch travels (:func:`is_fixed`): spaces whose batch is numpy
  arrays (``Box``, ``Discrete``, ``MultiDiscrete``, ``MultiBinary`` and
  ``Dict``/``Tuple`` of them) travel as arrays, the fast path; every other
  space (``Text``, ``Graph``, ``Sequence``, ``OneOf``, a custom ``Space``, or a
  ``Dict``/``Tuple`` holding one) travels as a 1-D object array of single
  elements, batched at the end with gymnasium's own ``concatenate``, as
  ``SyncVectorEnv`` batches it;
- whether the envs' spaces can be batched together (:func:`check_spaces`, with
  gymnasium's ``observation_mode``);
- whether a batch of actions belongs to the action space (:class:`ActionCheck`),
  with vectorized bound checks for the array spaces.

It owns no messages and no processes (:mod:`.protocol`, :mod:`.vector`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from gymnasium import spaces
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector.utils import batch_differing_spaces, batch_space

__all__ = ["InvalidActionError", "is_fixed", "objects", "check_spaces", "ActionCheck"]

_ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
_BUILTIN = _ARRAY_SPACES + (spaces.Dict, spaces.Tuple, spaces.Text, spaces.Graph,
                            spaces.Sequence, spaces.OneOf)


class InvalidActionError(ValueError, AssertionError):
    """An action is not in the action space; raised before anything is sent.

    Both a ``ValueError`` (a bad argument) and an ``AssertionError`` (what gymnasium's
    own envs raise from ``assert self.action_space.contains(action)``, through
    ``SyncVectorEnv`` and ``AsyncVectorEnv``), so code written for either catches it.
    """


def is_fixed(space: spaces.Space) -> bool:
    """Whether a batch of ``space`` is numpy arrays (possibly in dicts and tuples)."""
    if isinstance(space, spaces.Dict):
        return all(is_fixed(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return all(is_fixed(s) for s in space.spaces)
    return isinstance(space, _ARRAY_SPACES)


def objects(items: Sequence[Any]) -> np.ndarray:
    """A 1-D object array holding ``items`` as they are (numpy would otherwise turn
    tuples and equal-length sequences into more dimensions)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


# -- spaces of the envs -----------------------------------------------------------------
def check_spaces(obs_spaces: list, action_spaces: list, mode: Any, num_envs: int,
                 ) -> tuple[spaces.Space, spaces.Space]:
    """``(single_observation_space, observation_space)`` for envs with these spaces under
    gymnasium's ``observation_mode``, raising as ``AsyncVectorEnv`` does when the envs
    cannot be batched together (``RuntimeError``)."""
    spaces_ = _observations(obs_spaces, mode, num_envs)
    _same_actions(action_spaces)
    return spaces_


def _same_actions(action_spaces: list) -> None:
    first = action_spaces[0]
    odd = [i for i, s in enumerate(action_spaces) if s != first]
    if odd:
        raise RuntimeError(
            f"Some environments have an action space different from `{first}` (env "
            f"{odd[0]}: {action_spaces[odd[0]]}). In order to batch actions, the action "
            f"spaces from all environments must be equal.")


def _observations(obs_spaces: list, mode: Any, num_envs: int) -> tuple:
    if isinstance(mode, tuple):
        batched, single = mode
        _require_equiv(single, obs_spaces, "custom space")
        return single, batched
    single = obs_spaces[0]
    if mode == "same":
        odd = [i for i, s in enumerate(obs_spaces) if s != single]
        if odd:
            raise RuntimeError(
                f"RemoteVectorEnv(..., observation_mode='same') however the "
                f"sub-environments observation spaces are not equivalent. Env 0 has "
                f"{single}, env {odd[0]} {obs_spaces[odd[0]]}. If this is intentional, use "
                f"`observation_mode='different'` instead.")
        return single, batch_space(single, num_envs)
    _require_equiv(single, obs_spaces, "'different'")
    return single, batch_differing_spaces(obs_spaces)


def check_mode(mode: Any) -> Any:
    """``observation_mode`` as given, refused as ``AsyncVectorEnv`` refuses it."""
    if isinstance(mode, tuple) and len(mode) == 2:
        if not all(isinstance(s, spaces.Space) for s in mode):
            raise TypeError(f"Expected both elements of observation_mode to be Spaces, got "
                            f"{type(mode[0])} and {type(mode[1])}")
        return mode
    if isinstance(mode, str) and mode in ("same", "different"):
        return mode
    raise ValueError(f"Invalid `observation_mode`, expected: 'same' or 'different' or tuple "
                     f"of single and batch observation space, actual got {mode}")


def _require_equiv(single: spaces.Space, obs_spaces: list, mode: str) -> None:
    for i, space in enumerate(obs_spaces):
        if type(space) is not type(single) or not is_space_dtype_shape_equiv(single, space):
            raise RuntimeError(
                f"RemoteVectorEnv(..., observation_mode={mode}) however the "
                f"sub-environment's observation spaces do not share a common shape and "
                f"dtype (env 0: {single}, env {i}: {space}).")


# -- actions ----------------------------------------------------------------------------
Check = Callable[[Any], bool]


class ActionCheck:
    """Tells whether a batch of ``num_envs`` actions belongs to ``single`` (the envs'
    action space), cheaply: one vectorized test per array leaf (``Box`` bounds and
    shape, the range and integer dtype of ``Discrete``/``MultiDiscrete``, the 0/1 of
    ``MultiBinary``), ``contains`` per action only for gymnasium's other spaces, and
    nothing for custom ``Space`` subclasses (their ``contains`` may not describe what
    the env accepts)."""

    def __init__(self, single: spaces.Space, enabled: bool = True) -> None:
        self.single = single
        self.fixed = is_fixed(single)
        self._check: Optional[Check] = None
        if enabled and self.fixed:
            self._check = _batch_check(single)
        elif enabled and _builtin(single):
            self._check = self._each

    def __call__(self, actions: Any) -> None:
        """Raise :class:`InvalidActionError` unless every action is in the space."""
        if self._check is not None and not self._check(actions):
            raise self._explain(actions)

    def _each(self, actions: Any) -> bool:
        return all(self.single.contains(a) for a in actions)

    def _explain(self, actions: Any) -> InvalidActionError:
        bad, shown = [], None
        each = ([_row(actions, i) for i in range(_count(actions))] if self.fixed
                else list(actions))
        for i, one in enumerate(each):
            try:
                inside = self.single.contains(one)
            except Exception:
                inside = False
            if not inside:
                bad.append(i)
                shown = one if shown is None else shown
        where = (f"env {bad[0]}'s action {shown!r:.120} ({type(shown).__name__})" if bad
                 else f"the batch {actions!r:.120}")
        return InvalidActionError(
            f"RemoteVectorEnv: {where} is not in the action space {self.single}"
            f"{f'; envs with invalid actions: {bad[:20]}' if len(bad) > 1 else ''}. "
            f"Nothing was sent. Likely cause: a policy output outside the space (clip "
            f"Box actions with np.clip or gymnasium.wrappers.ClipAction on each env; "
            f"Discrete actions must be integers in range). Pass check_actions=False to "
            f"send actions unchecked, as gymnasium's vector envs do.")


def _builtin(space: spaces.Space) -> bool:
    if isinstance(space, spaces.Dict):
        return all(_builtin(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return all(_builtin(s) for s in space.spaces)
    return type(space) in _BUILTIN or type(space).__module__.startswith("gymnasium.")


def _count(actions: Any) -> int:
    leaf = actions
    while isinstance(leaf, (dict, tuple)) and not isinstance(leaf, np.ndarray) and len(leaf):
        leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
    return len(leaf)


def _row(actions: Any, i: int) -> Any:
    if isinstance(actions, dict):
        return {k: _row(v, i) for k, v in actions.items()}
    if isinstance(actions, tuple):
        return tuple(_row(v, i) for v in actions)
    return np.asarray(actions)[i] if not isinstance(actions, list) else actions[i]


def _batch_check(space: spaces.Space) -> Check:
    """A vectorized test of a batch of ``space`` (an array space, or dicts/tuples of them)."""
    if isinstance(space, spaces.Dict):
        parts = {k: _batch_check(s) for k, s in space.spaces.items()}
        return lambda a: (isinstance(a, dict) and a.keys() == parts.keys()
                          and all(check(a[k]) for k, check in parts.items()))
    if isinstance(space, spaces.Tuple):
        items = [_batch_check(s) for s in space.spaces]
        return lambda a: (isinstance(a, tuple) and len(a) == len(items)
                          and all(check(x) for check, x in zip(items, a)))
    if isinstance(space, spaces.Discrete):
        return _integers(int(space.start), int(space.start) + int(space.n), ())
    if isinstance(space, spaces.MultiDiscrete):
        return _integers(space.start, space.start + space.nvec, space.shape)
    if isinstance(space, spaces.MultiBinary):
        return _binary(tuple(space.shape))
    assert isinstance(space, spaces.Box)
    return _bounds(space)


def _shaped(a: Any, shape: tuple) -> Optional[np.ndarray]:
    """``a`` as an array when its rows have ``shape``, else None."""
    a = np.asarray(a)
    return a if a.shape[1:] == shape else None


def _binary(shape: tuple) -> Check:
    def check(a: Any) -> bool:
        a = _shaped(a, shape)
        return a is not None and bool(np.logical_or(a == 0, a == 1).all())
    return check


_UNSIGNED = {np.dtype(f"i{n}"): np.dtype(f"u{n}") for n in (1, 2, 4, 8)}


def _integers(low: Union[int, np.ndarray], high: Union[int, np.ndarray], shape: tuple) -> Check:
    if np.ndim(low) == 0:
        lo, span = int(low), int(high) - int(low)

        def check(a: Any) -> bool:
            if type(a) is not np.ndarray:
                a = np.asarray(a)
            kind = a.dtype.kind
            if kind not in "iu" or a.ndim != 1 or not a.size:
                return False
            # (argmax and argmin: the extremes without a ufunc reduction, a few times cheaper
            # on a batch of this size, and the check runs before every step is sent)
            if lo == 0:   # one pass: negative numbers read as unsigned are too large
                a = a.view(_UNSIGNED.get(a.dtype, a.dtype))
                return a[a.argmax()] < span
            return lo <= a[a.argmin()] and a[a.argmax()] < lo + span
        return check

    def check_each(a: Any) -> bool:
        a = np.asarray(a)
        return (a.dtype.kind in "iu" and a.shape[1:] == shape
                and bool((a >= low).all() and (a < high).all()))
    return check_each


def _bounds(space: spaces.Box) -> Check:
    shape = tuple(space.shape)
    low = None if np.all(np.isneginf(space.low)) else np.asarray(space.low)
    high = None if np.all(np.isposinf(space.high)) else np.asarray(space.high)
    # the same bound for every element (the common case): compare the extremes only
    lo = low.flat[0] if low is not None and (low == low.flat[0]).all() else None
    hi = high.flat[0] if high is not None and (high == high.flat[0]).all() else None

    def check(a: Any) -> bool:
        a = _shaped(a, shape)
        if a is None or a.dtype.kind not in "biuf" or not a.size:
            return a is not None and a.dtype.kind in "biuf"
        if low is not None and not (a.min() >= lo if lo is not None else (a >= low).all()):
            return False
        return high is None or bool(a.max() <= hi if hi is not None else (a <= high).all())
    return check
