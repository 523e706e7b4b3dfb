"""benchmarks/ncu_decode_kernels.py's reading of ncu's CSV (the profiling itself needs a GPU and
ncu): kernels grouped by ID in launch order, labelled by the driver's launch order, durations
in microseconds whatever unit ncu scaled them to."""

from __future__ import annotations

from benchmarks import ncu_decode_kernels as ncu

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value","Rule Name","Rule Type","Rule Description","Estimated Speedup Type",'
          '"Estimated Speedup"')


def row(kernel_id: int, name: str, metric: str, unit: str, value: str,
        grid: str = "(48, 1, 1)") -> str:
    return (f'"{kernel_id}","643","python3.12","127.0.0.1","{name}","1","7","(128, 1, 1)",'
            f'"{grid}","0","9.0","GPU Speed Of Light Throughput","{metric}","{unit}","{value}",')


def lora_csv() -> str:
    lines = ["==PROF== Connected to process 643 (/usr/bin/python3.12)", HEADER]
    # Written last kernel first: the launch order is the IDs'.
    for kernel_id in reversed(range(8)):
        name = "_expand_kernel" if kernel_id % 2 else "_shrink_kernel"
        lines += [row(kernel_id, name, "Duration", "ns", f"{1000 * (kernel_id + 1):,}"),
                  row(kernel_id, name, "DRAM Throughput", "%", "45.77"),
                  row(kernel_id, name, "Registers Per Thread", "register/thread", "96")]
    # A rule's row: no metric, its own fields.
    lines.append('"0","643","python3.12","127.0.0.1","_shrink_kernel","1","7","(128, 1, 1)",'
                 '"(48, 1, 1)","0","9.0","Occupancy","","","","Achieved Occupancy","OPT",'
                 '"text","local","12.5"')
    lines.append("==PROF== Disconnected from process 643")
    return "\n".join(lines)


def test_kernels_come_in_launch_order_with_their_metrics_and_labels():
    kernels = ncu.parse_details(lora_csv())
    assert [k["metrics"]["Duration"] for k in kernels] == [f"{1000 * (i + 1):,}"
                                                          for i in range(8)]
    rows = ncu.table_rows("many64", kernels)
    assert [r[1] for r in rows] == ["qkv shrink", "qkv expand", "o shrink", "o expand",
                                    "gate_up shrink", "gate_up expand", "down shrink",
                                    "down expand"]
    assert rows[1][:3] == ["many64", "qkv expand", "(48,1,1)"]
    cells = dict(zip([h for _, h in ncu.COLUMNS], rows[1][3:]))
    assert cells["us"] == "2.0" and cells["DRAM %"] == "45.77" and cells["registers"] == "96"
    assert cells["occupancy %"] == "-"  # not in this CSV


def test_matmul_labels_attach_split_k_reduces_and_durations_scale_by_unit():
    lines = [HEADER]
    names = ["nvjet_qkv", "nvjet_o", "nvjet_gate_up", "nvjet_down", "splitKreduce_kernel"]
    for i, name in enumerate(names):
        unit, value = ("usecond", "65.92") if i == 2 else ("ns", "16,896")
        lines.append(row(i, name, "Duration", unit, value))
    kernels = ncu.parse_details("\n".join(lines))
    assert ncu.kernel_labels("mm64", kernels) == ["qkv matmul", "o matmul", "gate_up matmul",
                                                  "down matmul", "down split-K reduce"]
    durations = [r[3] for r in ncu.table_rows("mm64", kernels)]
    assert durations == ["16.9", "16.9", "65.9", "16.9", "16.9"]
    attention = ncu.parse_details("\n".join(
        [HEADER, row(0, "_decode_split_kernel", "Duration", "ns", "44,064"),
         row(1, "_decode_reduce_kernel", "Duration", "ns", "4,960")]))
    assert ncu.kernel_labels("attn64", attention) == ["attention split", "attention reduce"]
