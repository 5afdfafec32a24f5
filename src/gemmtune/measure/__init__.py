"""How gemmtune measures, shared by the tuner and the bench: CUDA-graph timing over cold-L2
copies (``timing``), exclusive use of a GPU (``gpulock``), the ceilings and floors a time is
judged against (``ceilings``), and the correctness gate (``accuracy``)."""
