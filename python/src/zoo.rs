//! Zoo models by name, sized by keyword arguments.

use lanes_adaptor::Arch;
use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The names `Session.load_zoo` takes.
pub const NAMES: &[&str] = &[
    "mlp",
    "lenet",
    "resnet18_cifar",
    "resnet50",
    "resnet152",
    "inception_v3",
    "bert_base",
    "transformer",
];

struct Params<'a, 'py> {
    model: &'a str,
    dict: Option<&'a Bound<'py, PyDict>>,
    used: Vec<&'static str>,
}

impl Params<'_, '_> {
    fn get<T: for<'py2> FromPyObjectOwned<'py2>>(
        &mut self,
        key: &'static str,
        default: T,
    ) -> PyResult<T> {
        self.used.push(key);
        match self.dict.map(|d| d.get_item(key)).transpose()?.flatten() {
            Some(v) => v.extract::<T>().map_err(|e| {
                let e: PyErr = e.into();
                PyTypeError::new_err(format!("{}: parameter `{key}`: {e}", self.model))
            }),
            None => Ok(default),
        }
    }

    fn finish(&self) -> PyResult<()> {
        if let Some(d) = self.dict {
            for k in d.keys() {
                let k: String = k.extract()?;
                if !self.used.contains(&k.as_str()) {
                    return Err(PyTypeError::new_err(format!(
                        "{}: unknown parameter `{k}` (takes: {})",
                        self.model,
                        if self.used.is_empty() {
                            "none".to_string()
                        } else {
                            self.used.join(", ")
                        }
                    )));
                }
            }
        }
        Ok(())
    }
}

/// The architecture `name` stands for, its sizes from `params`.
pub fn arch(name: &str, params: Option<&Bound<'_, PyDict>>) -> PyResult<Arch> {
    let mut p = Params {
        model: name,
        dict: params,
        used: Vec::new(),
    };
    let a = match name {
        "mlp" => Arch::Mlp {
            inputs: p.get("inputs", 64usize)?,
            hidden: p.get("hidden", vec![64usize])?,
            classes: p.get("classes", 10usize)?,
        },
        "lenet" => Arch::LeNet {
            channels: p.get("channels", 1usize)?,
            image: p.get("image", 28usize)?,
            classes: p.get("classes", 10usize)?,
        },
        "resnet18_cifar" => Arch::ResNet18Cifar {
            classes: p.get("classes", 10usize)?,
        },
        "resnet50" => Arch::ResNet50,
        "resnet152" => Arch::ResNet152,
        "inception_v3" => Arch::InceptionV3,
        "bert_base" => Arch::BertBase {
            seq: p.get("seq", 128usize)?,
        },
        "transformer" => Arch::Transformer {
            vocab: p.get("vocab", 1000usize)?,
            seq: p.get("seq", 32usize)?,
            dim: p.get("dim", 64usize)?,
            heads: p.get("heads", 4usize)?,
            ff: p.get("ff", 128usize)?,
            classes: p.get("classes", 2usize)?,
        },
        other => {
            return Err(PyValueError::new_err(format!(
                "no zoo model `{other}` (the zoo has: {})",
                NAMES.join(", ")
            )))
        }
    };
    p.finish()?;
    Ok(a)
}
