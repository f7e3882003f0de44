"""The planner: the layout for a model on a world, chosen by a model of its
step, with the reasons, and a check of the prediction on this machine.

    clawcomm plan --nproc 4 --model gpt --global-batch 64              # the best few, and why
    clawcomm plan --nproc 4 --model gpt --global-batch 64 --check 4    # ... run for real
    clawcomm train --nproc 4 --layout auto --global-batch 64           # train with the first

1. **Profile** (:mod:`~clawcomm.plan.profile`, one process, a few seconds):
   each layer's forward and backward time and the bytes autograd saves for
   backward, at every micro-batch size a candidate uses; one optimizer
   step; all with the one intra-op thread a CPU rank runs with. On the
   CPU, each pipeline shape's passes in its schedule's order against back
   to back (:mod:`~clawcomm.plan.pass_order`), measured last, in what is
   left of the plan's 14 s.
2. **Search** (:mod:`~clawcomm.plan.search`): every layout the trainer can
   run the global batch with, named by ``TrainConfig``'s own fields: dp x
   pp (dp * pp = the world, pp at most the layers) x schedule (gpipe, 1f1b,
   zb1, interleaved with v = 2) x micro-batches (pp, 2 pp and 4 pp where
   the replica's batch divides; where none does, the others from pp to 4
   pp, then the smallest above) x ZeRO stage (0-3 where dp > 1); the
   compression is the command's unless ``--search-compression`` names
   wires to choose among, the sync method unless ``--search-sync`` names
   methods (every-step, local-sgd:H, diloco:H).
3. **Predict** each one's step (:mod:`~clawcomm.plan.step`): the pipeline
   on the pipeline's clock, the data-parallel traffic as the compressor
   says it goes on the wire, priced by the cost model, on the rank's
   timeline (:mod:`~clawcomm.plan.dp_timeline`), the optimizer, ranks
   taking turns where they outnumber the cores
   (:mod:`~clawcomm.plan.shared_cores`), and the memory of the fullest
   rank. Each rule the step depends on is asked of the room that owns it:
   what a compressor sends, what its codec costs and what it keeps
   (``clawcomm.compression``), what ZeRO leaves a rank
   (``clawcomm.parallel.zero``), the activations a schedule holds
   (``clawcomm.pipeline.schedules``), the collectives' times and the link
   rates (``clawcomm.cost_model``).
4. **Report** (:mod:`~clawcomm.plan.report`): the candidates within
   ``--max-memory-mb`` best first, the terms of each prediction, why the
   first beats the second, and the command that runs it. ``--check K``
   (:mod:`~clawcomm.plan.check`) trains the first K for a few steps each
   and prints predicted against measured step times and their rank
   correlation.

:mod:`~clawcomm.plan.cli` is the command; ``clawcomm train --layout auto``
calls ``search.choose``.
"""
