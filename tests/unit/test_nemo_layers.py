"""The list of layers the driver puts on NeMo-RL and the table of seams name each other: every layer's
target is a seam that names the layer back, and every layer a seam names exists."""

from __future__ import annotations

from bapo_nemo.nemo.layers import AFTER_SETUP, BEFORE_RAY, BEFORE_SETUP, LAYERS, Layer, Run, install_layers
from bapo_nemo.nemo.seams import SEAMS


def test_every_layer_touches_only_targets_whose_seam_names_it():
    seams = {seam.target: seam for seam in SEAMS}
    unlisted = [(layer.name, target) for layer in LAYERS for target in layer.targets
                if target not in seams or layer.name not in seams[target].layers]
    assert unlisted == []
    assert all(layer.targets for layer in LAYERS)


def test_every_layer_a_seam_names_exists_and_touches_that_seam():
    layers = {layer.name: layer for layer in LAYERS}
    dangling = [(seam.target, name) for seam in SEAMS for name in seam.layers
                if name not in layers or seam.target not in layers[name].targets]
    assert dangling == []


def test_layer_names_are_unique_and_stages_known():
    names = [layer.name for layer in LAYERS]
    assert len(names) == len(set(names))
    assert {layer.stage for layer in LAYERS} <= {BEFORE_RAY, BEFORE_SETUP, AFTER_SETUP}


def test_layers_install_in_list_order_and_the_first_is_innermost():
    """Three layers around a train function: the call passes through them outermost first, so the first
    installed is the last to see the call before the original."""
    seen: list[str] = []

    def wrapping(name):
        def install(run):
            inner = run.policy.train

            def train(*args):
                seen.append(name)
                return inner(*args)

            run.policy.train = train
        return install

    class Policy:
        def train(self, *args):
            seen.append("original")

    run = Run(config={}, bapo=None, off_path=set(), policy=Policy())
    layers = tuple(Layer(name, ("t",), "", AFTER_SETUP, wrapping(name)) for name in ("inner", "middle", "outer"))
    skipped = Layer("skipped", ("t",), "", AFTER_SETUP, wrapping("skipped"), applies=lambda run: False)
    later = Layer("later", ("t",), "", BEFORE_SETUP, wrapping("later"))
    assert install_layers(run, AFTER_SETUP, (*layers, skipped, later)) == ["inner", "middle", "outer"]
    run.policy.train()
    assert seen == ["outer", "middle", "inner", "original"]
