//! Byte amounts for people: error messages and tables print these.

const KIB: f64 = 1024.0;
const MIB: f64 = KIB * 1024.0;
const GIB: f64 = MIB * 1024.0;

/// `1288490188` -> `"1.20 GiB"`; small amounts keep a unit that shows them.
pub fn fmt_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else if b >= MIB {
        format!("{:.1} MiB", b / MIB)
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{bytes} B")
    }
}

/// Like [`fmt_bytes`] for a signed amount (a device over budget shows a minus sign).
pub fn fmt_signed(bytes: i64) -> String {
    if bytes < 0 {
        format!("-{}", fmt_bytes(bytes.unsigned_abs()))
    } else {
        fmt_bytes(bytes as u64)
    }
}
