"""Where the model's parts live when a profile names `split` devices beside the target.

The target holds the token embedding, the LM head, the final mixer, the MTP head (and its cache) and the decoder
layers from the first; each split device holds a run of whole decoder layers after them, the last run on the first
split device. A layer's weights and every slot's state of it (its K/V and indexer keys, or its recurrent state)
sit on one device, so a layer runs where it is and reads nothing from elsewhere: the hyper-connection streams
are handed across where the device changes (causal_lm.run_steps), twice a forward with one split device.

Which layers go where is the planner's choice (fit_estimate.choose_split), made before the weights are loaded from
the model's own byte counts; the context is then fitted over every device at once (fit.py).

A device here is a name as profiles write it ("cuda:1", "cpu"); two names may share one physical device (the
tests place layers on "cpu" and "cpu:1": each has its own budget, torch puts both on the CPU). No torch here: the
daemon's process keeps a placement for the worker it restarts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    target: str
    layers: tuple[str, ...]          # each decoder layer's device

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a placement needs at least one layer")

    @classmethod
    def single(cls, device, layers: int) -> "Placement":
        name = str(device)
        return cls(name, (name,) * layers)

    @classmethod
    def with_split(cls, target, layers: int, counts: list[tuple[str, int]]) -> "Placement":
        """The target's layers from the first; each split device in `counts` (name, layers) takes a run of layers
        from the end down, in order (the first named holds the last layers)."""
        names = [str(target)] * layers
        end = layers
        for name, count in counts:
            if count < 0 or count > end:
                raise ValueError(f"{name} cannot hold {count} layers: {end} are left of {layers}")
            names[end - count:end] = [name] * count
            end -= count
        return cls(str(target), tuple(names))

    @property
    def is_split(self) -> bool:
        return any(name != self.target for name in self.layers)

    @property
    def devices(self) -> list[str]:
        """Every device named, the target first."""
        seen = [self.target]
        for name in self.layers:
            if name not in seen:
                seen.append(name)
        return seen

    def runs(self) -> list[tuple[str, int, int]]:
        """(device, first layer, last layer) of each run of consecutive layers on one device."""
        runs: list[tuple[str, int, int]] = []
        for index, name in enumerate(self.layers):
            if runs and runs[-1][0] == name:
                runs[-1] = (name, runs[-1][1], index)
            else:
                runs.append((name, index, index))
        return runs

    def split_layers(self) -> dict[str, tuple[int, int]]:
        """{split device: (first layer, last layer)} of the layers off the target."""
        return {name: (first, last) for name, first, last in self.runs() if name != self.target}

    def describe(self) -> str:
        return ", ".join(f"layers {first}..{last} on {name}" for name, first, last in self.runs())

    def to_json(self) -> dict:
        return {"target": self.target, "runs": [{"device": name, "first": first, "last": last}
                                                for name, first, last in self.runs()]}

    @classmethod
    def from_json(cls, data: dict) -> "Placement":
        layers: list[str] = []
        for run in data["runs"]:
            layers += [run["device"]] * (run["last"] - run["first"] + 1)
        return cls(data["target"], tuple(layers))
