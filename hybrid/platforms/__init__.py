"""Where a mesh lives beyond one process: TensorFlow clusters (multi-host), TPU slices
(placement on the torus) and Cloud TPU supervision.

    cluster          connect, guard and watch a cluster; meshes over its tasks; start_server
      cluster_tasks    specs, tasks, their devices, probes and the errors that name tasks
      device_order     the order of the tasks' devices in a mesh (no TensorFlow)
    local_workers    a simulated mesh of capped devices: one local worker process each
    tpu_mesh         layouts on a tf.tpu.experimental.Topology: device names, TPUStrategy
      torus            a slice's chips, cores and hops (no TensorFlow)
      torus_placement  the search for the S × R placement on a torus (no TensorFlow)
    cloud_tpu        re-exports tpu_node (resolve, client) and tpu_supervisor (supervise)

The indented modules are parts of the one above, which re-exports their public names.
"""
