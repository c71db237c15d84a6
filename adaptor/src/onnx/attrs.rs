//! Typed look-ups of a node's attributes by name.

use super::proto::{AttributeProto, TensorProto};

/// A node's attributes.
#[derive(Debug, Clone, Copy)]
pub struct Attrs<'a>(pub &'a [AttributeProto]);

impl<'a> Attrs<'a> {
    fn get(&self, name: &str) -> Option<&'a AttributeProto> {
        self.0.iter().find(|a| a.name.as_deref() == Some(name))
    }
    pub fn int(&self, name: &str) -> Option<i64> {
        self.get(name).and_then(|a| a.i)
    }
    pub fn float(&self, name: &str) -> Option<f32> {
        self.get(name).and_then(|a| a.f)
    }
    pub fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.get(name).map(|a| a.ints.clone())
    }
    pub fn floats(&self, name: &str) -> Option<Vec<f32>> {
        self.get(name).map(|a| a.floats.clone())
    }
    pub fn string(&self, name: &str) -> Option<String> {
        self.get(name)
            .and_then(|a| a.s.as_deref())
            .map(|s| String::from_utf8_lossy(s).into_owned())
    }
    pub fn tensor(&self, name: &str) -> Option<&'a TensorProto> {
        self.get(name).and_then(|a| a.t.as_ref())
    }
}
