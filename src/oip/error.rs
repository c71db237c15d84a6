//! The protocol's error responses: an HTTP status and `{"error": "..."}`,
//! or a gRPC status with the same message.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lanes_adaptor::{ClientError, ErrorCode};

/// A request the front end refuses or could not serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// 404: no such model (or version) in the repository.
    #[error("{0}")]
    NotFound(String),
    /// 400: a malformed body, or tensors that do not fit the model.
    #[error("{0}")]
    BadRequest(String),
    /// 400: the model exists but is not loaded (unloaded, or it failed to
    /// load; the reason is in the message).
    #[error("{0}")]
    Unavailable(String),
    /// 413: a body over `--http-max-body`.
    #[error("{0}")]
    TooLarge(String),
    /// 503: over `--http-max-in-flight`, the service is at a limit, or it
    /// is stopping.
    #[error("{0}")]
    Overloaded(String),
    /// 500: the service failed the request.
    #[error("{0}")]
    Internal(String),
    /// 400 (UNIMPLEMENTED over gRPC): an extension that is turned off.
    #[error("{0}")]
    Unsupported(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BadRequest(_) | ApiError::Unavailable(_) | ApiError::Unsupported(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The gRPC status code of the same error.
    pub fn grpc_code(&self) -> tonic::Code {
        match self {
            ApiError::NotFound(_) => tonic::Code::NotFound,
            ApiError::BadRequest(_) => tonic::Code::InvalidArgument,
            ApiError::Unavailable(_) => tonic::Code::Unavailable,
            ApiError::TooLarge(_) | ApiError::Overloaded(_) => tonic::Code::ResourceExhausted,
            ApiError::Internal(_) => tonic::Code::Internal,
            ApiError::Unsupported(_) => tonic::Code::Unimplemented,
        }
    }

    /// A service error met while running a model's request.
    pub fn from_client(model: &str, e: &ClientError) -> ApiError {
        let msg = format!("model `{model}`: {e}");
        match e.code() {
            Some(ErrorCode::BadFeed | ErrorCode::UnknownFetch | ErrorCode::BadRequest) => {
                ApiError::BadRequest(msg)
            }
            Some(ErrorCode::Overloaded | ErrorCode::ShuttingDown) => ApiError::Overloaded(msg),
            Some(ErrorCode::TensorTooLarge | ErrorCode::FrameTooLarge) => ApiError::TooLarge(msg),
            _ => ApiError::Internal(msg),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = serde_json::json!({ "error": self.to_string() });
        (status, axum::Json(body)).into_response()
    }
}

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> tonic::Status {
        tonic::Status::new(e.grpc_code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_kind() {
        assert_eq!(ApiError::NotFound("x".into()).status(), 404);
        assert_eq!(ApiError::BadRequest("x".into()).status(), 400);
        assert_eq!(ApiError::TooLarge("x".into()).status(), 413);
        assert_eq!(ApiError::Overloaded("x".into()).status(), 503);
        let s = tonic::Status::from(ApiError::NotFound("unknown model `q`".into()));
        assert_eq!(s.code(), tonic::Code::NotFound);
        assert_eq!(s.message(), "unknown model `q`");
        assert_eq!(
            ApiError::BadRequest("x".into()).grpc_code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            ApiError::Overloaded("x".into()).grpc_code(),
            tonic::Code::ResourceExhausted
        );
        let e = ClientError::Service {
            code: ErrorCode::BadFeed,
            message: "shape".into(),
        };
        assert!(matches!(
            ApiError::from_client("m", &e),
            ApiError::BadRequest(m) if m.contains("shape") && m.contains("`m`")
        ));
    }
}
