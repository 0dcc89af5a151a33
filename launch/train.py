"""Trains a model with hybrid on a device mesh.

python -m launch.train --mesh="stage:2;replica:2" --micro_batches=4 --train_steps=40
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    from hybrid import schedule  # no TensorFlow: safe before the device count is set

    flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu"], "Device type of the mesh.")
    flags.DEFINE_string("mesh", "stage:2;replica:2", "Mesh spec 'stage:S;replica:R'.")
    flags.DEFINE_integer("micro_batches", 4, "Micro-batches per replica per step.", lower_bound=1)
    flags.DEFINE_enum("schedule", "gpipe", schedule.names(), "Pipeline schedule.")
    flags.DEFINE_integer(
        "virtual_stages", 1, "Model stages per device (--schedule=interleaved).", lower_bound=1
    )
    flags.DEFINE_enum("remat", "except_last", ["never", "except_last", "always"], "Recompute mode.")
    flags.DEFINE_integer(
        "global_batch_size", 256, "Examples per step, all replicas.", lower_bound=1
    )
    flags.DEFINE_integer("train_steps", 40, "Training steps.", lower_bound=1)
    flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.", lower_bound=0.0)
    flags.DEFINE_integer("seed", 0, "Seed for weights and data.")
    flags.DEFINE_integer("width", 256, "MLP width.", lower_bound=1)
    flags.DEFINE_integer("depth", 4, "MLP blocks (3 layers each, plus a head).", lower_bound=1)
    flags.DEFINE_bool("jit_compile", True, "XLA-compile the stage programs.")
    flags.DEFINE_integer("log_every", 5, "Log every N steps.", lower_bound=1)
    flags.DEFINE_integer(
        "simulated_devices", None, "CPU only: logical devices to simulate (default: mesh size)."
    )

    def _check_batch(values: dict) -> bool:
        from hybrid.mesh import parse_spec

        try:
            stages, replicas = parse_spec(values["mesh"])
        except ValueError as err:
            raise flags.ValidationError(f"--mesh: {err}") from err
        if values["schedule"] == "interleaved" and values["micro_batches"] % stages:
            raise flags.ValidationError(
                f"--schedule=interleaved needs --micro_batches ({values['micro_batches']}) to be a "
                f"multiple of the pipeline stages ({stages}, from --mesh)"
            )
        if values["virtual_stages"] > 1 and values["schedule"] != "interleaved":
            raise flags.ValidationError(
                f"--virtual_stages={values['virtual_stages']} needs --schedule=interleaved "
                f"(got --schedule={values['schedule']})"
            )
        parts = replicas * values["micro_batches"]
        if values["global_batch_size"] % parts:
            raise flags.ValidationError(
                f"--global_batch_size={values['global_batch_size']} is not divisible by replicas "
                f"({replicas}, from --mesh) × --micro_batches ({values['micro_batches']}) = {parts}"
            )
        return True

    flags.register_multi_flags_validator(
        ["mesh", "micro_batches", "global_batch_size", "schedule", "virtual_stages"], _check_batch
    )

    def _check_mesh_fits(values: dict) -> bool:
        from hybrid.mesh import parse_spec

        try:
            stages, replicas = parse_spec(values["mesh"])
        except ValueError:
            return True  # reported by the batch validator
        layers = 3 * values["depth"] + 1
        model_stages = stages * values["virtual_stages"]
        if model_stages > layers:
            raise flags.ValidationError(
                f"--mesh and --virtual_stages make {model_stages} stages but --depth="
                f"{values['depth']} gives the model only {layers} layers; use fewer stages or a "
                "larger --depth"
            )
        devices = values["simulated_devices"]
        if values["platform"] == "cpu" and devices is not None and devices < stages * replicas:
            raise flags.ValidationError(
                f"--mesh={values['mesh']} needs {stages * replicas} devices but "
                f"--simulated_devices={devices}; raise --simulated_devices or shrink --mesh"
            )
        return True

    flags.register_multi_flags_validator(
        ["mesh", "depth", "simulated_devices", "platform", "virtual_stages"], _check_mesh_fits
    )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import hybrid
    from hybrid.mesh import parse_spec
    from hybrid.trainer import TrainConfig, train

    stages, replicas = parse_spec(FLAGS.mesh)
    if FLAGS.platform == "cpu":
        hybrid.simulate_cpu_devices(FLAGS.simulated_devices or stages * replicas)
    config = TrainConfig(
        mesh=FLAGS.mesh,
        micro_batches=FLAGS.micro_batches,
        schedule=FLAGS.schedule,
        virtual_stages=FLAGS.virtual_stages,
        remat=FLAGS.remat,
        global_batch_size=FLAGS.global_batch_size,
        train_steps=FLAGS.train_steps,
        learning_rate=FLAGS.learning_rate,
        seed=FLAGS.seed,
        width=FLAGS.width,
        depth=FLAGS.depth,
        jit_compile=FLAGS.jit_compile,
        log_every=FLAGS.log_every,
    )
    result = train(config)
    print(
        f"done: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
        f"{result.examples_per_second:.1f} examples/s"
    )


if __name__ == "__main__":
    define_flags()
    app.run(main)
