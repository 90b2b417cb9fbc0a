//! Token ids from Python: a buffer (array('I'), numpy uint32/int32/int64) is copied in one go;
//! any other sequence of ints is converted item by item.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

/// Wider or signed ids to u32, naming the first one out of range.
fn narrow<T: Copy + TryInto<u32> + std::fmt::Display>(items: Vec<T>) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(items.len());
    for (i, &t) in items.iter().enumerate() {
        match t.try_into() {
            Ok(v) => out.push(v),
            Err(_) => {
                return Err(PyValueError::new_err(format!(
                    "token {i} is {t}, outside [0, 2**32)"
                )))
            }
        }
    }
    Ok(out)
}

fn from_list(list: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(list.len());
    for item in list.iter() {
        out.push(item.extract::<u32>()?);
    }
    Ok(out)
}

pub fn extract_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        return buf.to_vec(py);
    }
    if let Ok(buf) = PyBuffer::<i64>::get(obj) {
        return narrow(buf.to_vec(py)?);
    }
    if let Ok(buf) = PyBuffer::<i32>::get(obj) {
        return narrow(buf.to_vec(py)?);
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(PyTypeError::new_err(
            "tokens must be token ids (ints), not text or bytes",
        ));
    }
    let items = match obj.cast::<PyList>() {
        Ok(list) => from_list(list),
        Err(_) => obj.extract::<Vec<u32>>(),
    };
    items.map_err(|e| {
        PyTypeError::new_err(format!(
            "tokens must be a sequence of ints in [0, 2**32) or a uint32/int32/int64 buffer: {e}"
        ))
    })
}
